"""The scheduler's record of a request: n sequences over one prompt, how far each is computed, and where its
images lie (a cached prefix is cut back to an image's start, never into it)."""

from __future__ import annotations

from servelm.engine.sequence import SeqStatus, SequenceGroup
from servelm.engine.types import MediaChunk, MediaSpan, SamplingParams


def test_a_request_of_n_choices_is_n_sequences_over_its_prompt_each_with_its_own_key():
    g = SequenceGroup("r", (1, 2, 3), SamplingParams(max_tokens=8, n=3))
    assert [s.index for s in g.seqs] == [0, 1, 2] and len({s.key for s in g.seqs}) == 3
    assert all(s.token_ids == [1, 2, 3] and s.token_ids is not g.seqs[0].token_ids for s in g.seqs[1:])
    seq = g.seqs[0]
    seq.token_ids.append(9)
    seq.num_computed = 2
    assert seq.num_generated == 1 and seq.num_pending == 2
    assert g.live == g.seqs and not g.finished
    for s in g.seqs:
        s.status = SeqStatus.FINISHED
    assert g.finished and g.live == []


def test_images_are_found_by_position_and_a_prefix_never_ends_inside_one():
    image = MediaSpan(4, MediaChunk(b"img", 0, 6))  # positions 4..9
    g = SequenceGroup("r", tuple(range(1, 15)), SamplingParams(max_tokens=8), media=(image,))
    assert g.span_at(3) is None and g.span_at(4) is image and g.span_at(9) is image and g.span_at(10) is None
    assert g.next_span(0) is image and g.next_span(5) is None
    assert g.whole(7) == 4, "a prefix ending inside the image goes back to its start"
    assert g.whole(4) == 4 and g.whole(10) == 10 and g.whole(3) == 3
