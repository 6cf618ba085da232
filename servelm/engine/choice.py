"""A request's state beside the scheduler's: what each choice's next row is sampled with, and what its output is made
of so far.

The output processor makes it for a new request (OutputProcessor.prepare, filed by attach on the engine thread) and
keeps it by sequence key until the request ends; the sampler reads it (a choice's RNG and penalties, its grammar
matcher and a thought's forced token shape its row) and the output processor moves it on, a token at a time. The scheduler's state of the
same sequences (engine/sequence.py) is not touched here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llguidance import LLMatcher

from servelm.constrain.grammars import plain_error
from servelm.engine.beam import BeamSearch
from servelm.engine.detokenizer import Detokenizer
from servelm.engine.plan import SeqKey
from servelm.engine.sampling import SamplerState
from servelm.engine.sequence import SequenceGroup
from servelm.engine.thinking import ThinkTracker
from servelm.engine.types import TokenLogprob
from servelm.errors import ConstraintFailed


@dataclass(eq=False)
class RequestState:
    """One request's: its choices, its beam search, and what the first output carries."""

    group: SequenceGroup  # the scheduler's (read here only: its id, prompt, params, timings and cached tokens)
    choices: list[Choice] = field(default_factory=list)
    beam: BeamSearch | None = None  # shared by every beam of a beam-search request
    prompt_logprobs: dict[int, TokenLogprob] | None = None  # by position, while the prompt is read
    first_token_at: float = 0.0  # perf_counter time of its first output
    failed: bool = False  # it failed in this step or before: nothing more of it is processed

    @property
    def request_id(self) -> str:
        return self.group.request_id


@dataclass(eq=False)
class Choice:
    """One sequence's state, from its admission to its last output."""

    key: SeqKey
    index: int
    request: RequestState
    sampler: SamplerState
    detok: Detokenizer
    matcher: LLMatcher | None = None  # the grammar matcher of a constrained choice (llguidance's object)
    free_unless: tuple[str, ...] = ()  # see Constraint.free_unless
    head: str = ""  # the output so far, while free_unless is undecided
    tokens: list[int] = field(default_factory=list)  # taken since the last output was sent
    logprobs: list[TokenLogprob] | None = None  # theirs, when asked for
    cumulative: float = 0.0
    grammar_param: str | None = None  # the request parameter the matcher's grammar came from
    think: ThinkTracker | None = None  # a choice that may think: its thought's tokens, and its budget
    generated: int = 0  # tokens taken (a beam's: the search's)
    draft_tokens: int = 0  # speculative guesses its steps read, and how many of them held
    draft_accepted: int = 0
    done: bool = False  # its last output is made

    @property
    def live(self) -> bool:
        return not self.done and not self.request.failed


def constraint_failed(choice: Choice) -> ConstraintFailed:
    error = choice.matcher.get_error() if choice.matcher is not None else "the grammar ended"
    return ConstraintFailed(f"The output constraint could not be followed after {choice.generated} tokens: "
                            f"{plain_error(error)}.", choice.grammar_param)
