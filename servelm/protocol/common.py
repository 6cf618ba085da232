"""Wire shapes shared by every endpoint."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# Every other integer a client sends is within 32 bits, bounded where the body is parsed (a 400 naming the field):
# none reaches the engine's arithmetic (a float of it, a product) at a size that overflows (docs/api.md)
MIN_INT, MAX_INT = -(2**31), 2**31 - 1
Int32 = Annotated[int, Field(ge=MIN_INT, le=MAX_INT)]  # token ids as prompts (their vocabulary is checked later)
Priority = Int32  # vLLM's: lower runs first (default 0)
Count = Annotated[int, Field(ge=0, le=MAX_INT)]  # token counts and budgets, token ids, ids
PositiveCount = Annotated[int, Field(ge=1, le=MAX_INT)]  # max_tokens and the like
# OpenAI takes any 64-bit integer as a seed; a negative one is read as its two's complement (engine/sampling.py)
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# Ollama's keep_alive: seconds (a negative number: for ever), or a duration such as "5m"; a number within 32 bits
KeepAlive = (Annotated[str, Field(max_length=64)] | Int32
             | Annotated[float, Field(ge=MIN_INT, le=MAX_INT)])
# Beam search divides a score by length ** length_penalty: beyond ±10 that overflows or divides by zero
LENGTH_PENALTY_LIMIT = 10.0


class WireModel(BaseModel):
    """A request body: strict types (no "1" for 1, no true for 1.0), no unknown fields, and finite numbers
    (JSON has no NaN or Infinity, but lenient encoders write them and would reach the engine's arithmetic)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(WireModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class LoraChoice(WireModel):
    id: Count
    scale: Annotated[float, Field(ge=-10.0, le=10.0)] | None = None


class SamplingExtras(WireModel):
    """The fields every text-generating request shares (chat, completions, Responses): the model, how tokens are
    drawn and what stops them, and the annotations."""

    model: str
    # sampling
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # stopping
    stop: str | list[str] | None = None
    stop_token_ids: list[Count] | None = None
    ignore_eos: bool | None = None
    min_tokens: Count | None = None
    skip_special_tokens: bool | None = None
    # the chat template's switches (vLLM's), e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: lower runs first, and may take a running request's slot from a higher number (default 0)
    priority: Priority | None = None
    # llama-server's: the answer carries `timings` (prompt and generation times, and the time it waited)
    timings_per_request: bool | None = None
    # llama-server's: LoRA adapters by id (their order in /v1/models) and scale for this request
    lora: Annotated[list[LoraChoice], Field(max_length=64)] | None = None
    # Ollama's: how long a model loaded on demand stays loaded after this request ("5m", seconds, 0, -1)
    keep_alive: KeepAlive | None = None
    # annotations: they describe the request to the platform and change nothing in the answer
    user: str | None = None
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None
    # OpenAI's hint for its prompt cache: here it joins requests of one key on the Ray router's replica
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = None
    # vLLM's: prefix-cache entries are shared only between requests of the same key and the same salt
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None


class GenerationFields(SamplingExtras):
    """The fields of the two completion APIs (chat and legacy completions)."""

    n: Annotated[int, Field(ge=1, le=128)] | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    # beam search (OpenVINO Model Server, vLLM)
    use_beam_search: bool | None = None
    length_penalty: Annotated[float, Field(ge=-LENGTH_PENALTY_LIMIT, le=LENGTH_PENALTY_LIMIT)] | None = None
    diversity_penalty: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    num_beam_groups: Annotated[int, Field(ge=1, le=128)] | None = None  # divides best_of
    early_stopping: bool | None = None
    max_tokens: PositiveCount | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM's: the logprob of every prompt token after the first, with this many most likely alternatives
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # output
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class NamedEvent(ResponseModel):
    """A stream event whose type names it on the wire (`event: <type>`): the Responses and Messages APIs'."""

    type: str


# What one request may hold, bounded before any work is done on it (the body is at most --max-body-bytes too):
# messages (OpenAI's own cap on chat messages is 2,048), content parts of one message, and tools (OpenAI's 128).
MAX_MESSAGES = 2048
MAX_PARTS = 256
MAX_TOOLS = 128


class ModelCard(ResponseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "servelm"
    max_model_len: int | None = None
    root: str | None = None  # the deployment an id names (itself, or an alias's); null for a weighted endpoint
    # what the model reads, as llama-server's /props says it: {"vision": true} with a projector (--mmproj)
    modalities: dict[str, bool] | None = None
    # what the model is and how it is served (a text deployment's; null where unknown or not ours to say)
    quantization: str | None = None  # the model file's type: Q4_K_M, F16, …
    trained_context_length: int | None = None  # max_model_len is what is served, within --kv-budget-mib
    chat_template: str | None = None  # where its template came from: gguf, file, builtin:NAME or fallback (ChatML)
    tool_call_format: str | None = None  # hermes, llama3_json or mistral; "(prompted)" when the template has no tools
    reasoning_markers: list[str] | None = None  # the thought's opening and closing markers, when it has them
    exact: bool | None = None  # answers bitwise the same under any load: the start-up self-check's finding
    exactness: str | None = None  # its words: the fences it took, or why it is not exact
    # whether a prompt's whole tiles are read on flash attention's tiled kernel (CPU), and why: a decoding step that
    # reads one takes that tile's pass (--prompt-tiles)
    prompt_tiles: str | None = None
    placement: str | None = None  # where its layers run: "CPU", or the GPU and how many of its layers
    # false where it answers /v1/embeddings: inputs share forward passes, and a vector may differ in its low digits
    # with what shared its pass (docs/exactness.md); null where it answers none
    embeddings_exact: bool | None = None
    # llama-server's router field: {"value": "loaded" | "loading" | "unloaded" | "failed", "reason"?: why it failed}
    status: dict[str, Any] | None = None
    parent: str | None = None  # vLLM's: a LoRA adapter's base model (root: the adapter's file)


class ErrorDetail(ResponseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(ResponseModel):
    """Every failure's body (Azure ML's paths add `status`, `code`, `message` and `detail` around it)."""

    error: ErrorDetail


class ModelList(ResponseModel):
    object: str = "list"
    data: list[ModelCard]
