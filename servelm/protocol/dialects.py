"""Wire shapes of the platform dialects that are not OpenAI's: DJL LMI's native schema on SageMaker
(`POST /invocations` with `{"inputs", "parameters"}`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, RootModel

from servelm.protocol.common import MAX_INT, Penalty, PositiveCount, Probability, ResponseModel, Seed, WireModel


class DjlParameters(WireModel):
    """DJL LMI's generation parameters (Hugging Face's names). Greedy unless `do_sample` is true, or a
    sampling knob (temperature, top_p, top_k) is given without `do_sample`."""

    max_new_tokens: PositiveCount | None = None
    do_sample: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: list[str] | None = None
    stop_sequences: list[str] | None = None  # TGI's name for `stop`
    ignore_eos: bool | None = None
    details: bool | None = None  # add finish_reason, token counts and each token's id, text and log_prob
    return_full_text: bool | None = None  # the prompt comes first in generated_text


class DjlRequest(WireModel):
    inputs: str | Annotated[list[str], Field(min_length=1)]
    model: str | None = None  # which deployment (not DJL's: /invocations fills it in, see service/dialects.py)
    parameters: DjlParameters | None = None
    stream: bool | None = None


class DjlToken(ResponseModel):
    id: int
    text: str
    log_prob: float


class DjlDetails(ResponseModel):
    finish_reason: str  # "length", "eos_token" or "stop_sequence"
    generated_tokens: int
    inputs: str
    tokens: list[DjlToken]


class DjlOutput(ResponseModel):
    """`{"generated_text"}`, with `details` (a DjlDetails) only when asked for (an extra field, so that a
    plain answer has no `details: null`)."""

    generated_text: str


class DjlOutputs(RootModel[list[DjlOutput]]):
    """The answer to a list of inputs: one output each, in order."""


class DjlStreamLine(ResponseModel):
    """One jsonlines line of a native stream: a token, then (last line) the whole text and the details."""

    token: DjlToken | None = None
    generated_text: str | None = None
    details: DjlDetails | None = None
