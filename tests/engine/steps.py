"""Driving the scheduler by hand, as the engine's step does: hand-built SampledStep and StepResult values in, and a
scheduler that remembers every sequence it was given, so that a test reads a plan's chunks by their keys."""

from __future__ import annotations

from servelm.engine.beam import beam_hosts
from servelm.engine.output import BeamMove, Finish, StepResult
from servelm.engine.plan import ScheduledChunk, SeqKey, StepPlan
from servelm.engine.sampler import Drawn, SampledStep
from servelm.engine.scheduler import Scheduler
from servelm.engine.sequence import Sequence, SequenceGroup


def drawn(tokens: dict[SeqKey, int]) -> SampledStep:
    return SampledStep({key: Drawn([token], [None]) for key, token in tokens.items()})


class Recording(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.known: dict[SeqKey, Sequence] = {}

    def add(self, group: SequenceGroup) -> None:
        super().add(group)
        self.known.update((s.key, s) for s in group.seqs)

    def seq(self, key: SeqKey) -> Sequence:
        return self.known[key]

    def group(self, chunk: ScheduledChunk) -> SequenceGroup:
        return self.known[chunk.seq].group

    def record(self, plan: StepPlan, tokens: dict[SeqKey, int]) -> None:
        """The step's update when the model drew tokens[key] for each key (and nothing finished)."""
        self.update(plan, drawn(tokens), StepResult())

    def finish(self, seq: Sequence) -> None:
        """The output processor finished the sequence (between steps)."""
        self.update(StepPlan(), SampledStep(), StepResult(events=[Finish(seq.key)]))

    def rebeam(self, group: SequenceGroup, parents: list[int], tokens: list[int]) -> list[int]:
        """The output processor moved the group's beams: returns which sequence holds each new beam."""
        self.update(StepPlan(), SampledStep(), StepResult(events=[BeamMove(group.request_id, tuple(parents),
                                                                            tuple(tokens))]))
        return beam_hosts(parents, len(group.seqs))


def request_ids(engine) -> dict[SeqKey, str]:
    """Every sequence key the engine's scheduler is given from now on, with its request's id (a plan's chunks name
    sequences by key; a test reads the runner's plans after the requests are gone)."""
    known: dict[SeqKey, str] = {}
    add = engine.scheduler.add

    def remember(group: SequenceGroup) -> None:
        known.update((s.key, group.request_id) for s in group.seqs)
        add(group)

    engine.scheduler.add = remember
    return known
