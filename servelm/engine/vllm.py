"""VllmEngine: the Engine protocol over vLLM's async engine, for GPU deployments (`engine = "vllm"`).

servelm keeps the API, routing, limits and metrics; vLLM schedules, batches and samples on the GPU (its
kernels, paged KV cache, prefix caching and tensor parallelism). Only this module imports vllm, and only
inside VllmEngine.create: the package imports everywhere, vLLM installed or not (`pip install servelm[vllm]`).

The translation between the two is small pure functions over plain values (tests/engine/test_vllm_mapping.py
runs them without vLLM): SamplingParams → vllm.SamplingParams keyword arguments, RequestOutput (DELTA kind)
→ GenerationOutput, vLLM's logprob dicts → TokenLogprob (hf_vocab.py gives each token's bytes).
What vLLM cannot do here is a 400 (check_supported), never silently dropped: servelm's grammars (response_format,
structured outputs, tools; the deployment has no Grammars, so the service refuses them while preparing) and
beam search. best_of > n runs best_of samples in vLLM and the service keeps the n most likely, as it does for
LocalEngine.

Differences from LocalEngine that no request can see as an error: logprobs are vLLM's (by default the raw
model distribution, before logit_bias and penalties: vLLM's `logprobs_mode` engine argument changes that), and
a seed gives vLLM's sequence, not llama.cpp's.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from servelm.engine.hf_vocab import HfTokenizer
from servelm.engine.types import EngineStats, FinishReason, GenerationOutput, GenerationRequest, SamplingParams, TokenLogprob
from servelm.errors import InvalidParameter, ServerError

log = logging.getLogger("servelm.engine.vllm")

INSTALL_HINT = "this deployment runs on vLLM, which is not installed: pip install 'servelm[vllm]' (needs a CUDA GPU)"
DEFAULT_MAX_SEQS = 256  # vLLM's max_num_seqs when the engine does not say
_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass(frozen=True)
class VllmOptions:
    """What AsyncEngineArgs gets for one deployment (from config.VllmSettings)."""

    model: str  # a Hugging Face repo id or a local directory
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    dtype: str = "auto"
    extra: Mapping[str, Any] = field(default_factory=dict)  # any other AsyncEngineArgs field, by name


# -- pure translation: servelm → vLLM --------------------------------------------------------------------
def engine_args(options: VllmOptions) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments; an extra argument may not repeat a named one."""
    named: dict[str, Any] = {"model": options.model, "tensor_parallel_size": options.tensor_parallel_size,
                             "gpu_memory_utilization": options.gpu_memory_utilization, "dtype": options.dtype}
    if options.max_model_len is not None:
        named["max_model_len"] = options.max_model_len
    clash = sorted(set(options.extra) & {*named, "max_model_len"})
    if clash:
        raise ValueError(f"vLLM engine arguments given twice (as settings and in engine_args): {', '.join(clash)}")
    return {**named, **options.extra}


def check_supported(params: SamplingParams, constrained: bool) -> None:
    """Raise InvalidParameter (400) for what a vLLM deployment cannot do."""
    if constrained:
        raise InvalidParameter(
            "Constrained output (response_format, structured_outputs, guided_*, tools) is not available on this "
            "deployment: it runs on vLLM, and servelm's grammars run in its own engine only.",
            "response_format", code="unsupported_parameter",
        )
    if params.beam is not None:
        raise InvalidParameter(
            "Beam search (use_beam_search, or best_of > 1 at temperature 0) is not available on this deployment: "
            "it runs on vLLM, whose streaming engine samples only.", "use_beam_search", code="unsupported_parameter",
        )


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """vllm.SamplingParams keyword arguments (the caller adds output_kind=DELTA).

    best_of > n runs best_of samples (vLLM's n) and asks for logprobs so that each reports its cumulative
    logprob: the service keeps the n most likely, as it does for LocalEngine's samples."""
    logprobs = params.logprobs if params.logprobs is not None else (0 if params.wants_cumulative else None)
    return {
        "n": params.num_seqs,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # -1: no limit, in every vLLM version
        "min_p": params.min_p,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": dict(params.logit_bias) or None,
        "stop": list(params.stop) or None,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "ignore_eos": params.ignore_eos,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
    }


def is_client_error(exc: BaseException) -> bool:
    """vLLM rejects a request it cannot take with a ValueError (VLLMValidationError in recent versions)."""
    return isinstance(exc, ValueError) or any(c.__name__ in ("VLLMClientError", "VLLMValidationError")
                                              for c in type(exc).__mro__)


# -- pure translation: vLLM → servelm --------------------------------------------------------------------
def finish(reason: str | None, stop_reason: str | int | None,
           requested_stop_ids: frozenset[int]) -> tuple[FinishReason | None, str | int | None]:
    """vLLM's finish_reason and stop_reason → ours. vLLM reports the model's extra end-of-generation ids (from
    its generation config) as stop token ids; to servelm they are EOS, whose stop_reason is None."""
    if reason is None:
        return None, None
    mapped = _REASONS.get(str(reason))
    if mapped is None:
        raise ServerError(f"the vLLM engine ended a sequence with finish reason {reason!r}")
    if mapped is not FinishReason.STOP:
        return mapped, None
    if isinstance(stop_reason, int) and stop_reason not in requested_stop_ids:
        stop_reason = None
    return mapped, stop_reason


def token_logprob(token: int, entries: Mapping[int, Any], k: int) -> TokenLogprob:
    """One position of vLLM's logprobs ({token id: Logprob(logprob, rank, …)}: the k most likely and the token
    taken) → TokenLogprob. -inf is never listed among the most likely."""
    ranked = sorted(((int(t), float(e.logprob)) for t, e in entries.items()), key=lambda te: -te[1])
    top = tuple((t, lp) for t, lp in ranked[:k] if lp != -math.inf)
    chosen = entries.get(token)
    if chosen is None:
        return TokenLogprob(token, -math.inf, top, len(entries) + 1)
    logprob = float(chosen.logprob)
    rank = getattr(chosen, "rank", None)
    if rank is None:  # not given: at least one more than the listed tokens more likely than it
        rank = 1 + sum(1 for _, lp in ranked if lp > logprob)
    return TokenLogprob(token, logprob, top, int(rank))


def prompt_logprobs(prompt: Sequence[int], raw: Sequence[Mapping[int, Any] | None] | None,
                    k: int) -> list[TokenLogprob | None] | None:
    """vLLM's prompt_logprobs (None for the first token) → ours, one entry per prompt token."""
    if raw is None:
        return None
    out: list[TokenLogprob | None] = [None] * len(prompt)
    for pos, entries in enumerate(raw[: len(prompt)]):
        if entries is not None and pos > 0:
            out[pos] = token_logprob(prompt[pos], entries, k)
    return out


class OutputTranslator:
    """One request's vLLM RequestOutputs (DELTA kind: each carries only what is new) → GenerationOutputs."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self._stop_ids = frozenset(request.params.stop_token_ids)
        self._counts: dict[int, int] = {}  # choice index → tokens generated so far
        self._prompt_pending = request.params.prompt_logprobs is not None

    def convert(self, raw: Any) -> list[GenerationOutput]:
        cached = getattr(raw, "num_cached_tokens", None) or 0
        outs = [o for o in (self._choice(c, cached) for c in raw.outputs) if o is not None]
        if outs and self._prompt_pending and getattr(raw, "prompt_logprobs", None) is not None:
            k = self.request.params.prompt_logprobs or 0
            outs[0].prompt_logprobs = prompt_logprobs(self.request.prompt_token_ids, raw.prompt_logprobs, k)
            self._prompt_pending = False
        return outs

    def _choice(self, c: Any, cached: int) -> GenerationOutput | None:
        params = self.request.params
        ids = [int(t) for t in (c.token_ids or ())]
        entries = list(c.logprobs) if c.logprobs else []
        self._counts[c.index] = count = self._counts.get(c.index, 0) + len(ids)
        reason, stop_reason = finish(c.finish_reason, c.stop_reason, self._stop_ids)
        if reason is FinishReason.STOP and not isinstance(stop_reason, str) and ids:
            ids.pop()  # the EOS or stop token that ended the choice is counted, not reported (as LocalEngine)
            entries = entries[: len(ids)]
        logprobs = None
        if params.logprobs is not None:
            logprobs = [token_logprob(t, e, params.logprobs) for t, e in zip(ids, entries)]
        if not (c.text or ids or reason):
            return None
        return GenerationOutput(
            self.request.request_id, c.index, c.text or "", ids, finish_reason=reason, stop_reason=stop_reason,
            prompt_tokens=len(self.request.prompt_token_ids), completion_tokens=count, cached_tokens=cached,
            logprobs=logprobs, cumulative_logprob=c.cumulative_logprob or 0.0,
        )


# -- the engine -----------------------------------------------------------------------------------------
class VllmEngine:
    """Engine over vLLM's AsyncLLM. Built before the server starts; its output loop starts on the server's
    event loop with the first request (so every request must come from that one loop)."""

    def __init__(self, llm: Any, tokenizer: HfTokenizer, *, make_params: Callable[[dict[str, Any]], Any],
                 context_window: int, vocab_size: int, max_num_seqs: int = DEFAULT_MAX_SEQS) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.context_window = context_window
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self._make_params = make_params  # plain kwargs → vllm.SamplingParams (output_kind DELTA)
        self._seqs: dict[str, int] = {}  # request id → its sequences, while it runs in vLLM
        self._tasks: set[asyncio.Future[Any]] = set()  # aborts on their way

    @classmethod
    def create(cls, options: VllmOptions) -> VllmEngine:
        """Load the model into vLLM (minutes on a GPU); RuntimeError with the install command without vLLM."""
        try:
            import vllm
            from vllm.sampling_params import RequestOutputKind
        except ImportError as exc:
            raise RuntimeError(f"{INSTALL_HINT} ({exc})") from None
        engine_class: Any = getattr(vllm, "AsyncLLMEngine", None)  # AsyncLLM (v1) in every release since 0.8
        if engine_class is None:
            from vllm.v1.engine.async_llm import AsyncLLM

            engine_class = AsyncLLM
        llm = engine_class.from_engine_args(vllm.AsyncEngineArgs(**engine_args(options)))
        tokenizer = HfTokenizer(_hf_tokenizer(llm, options))
        config = getattr(llm, "model_config", None)
        scheduler = getattr(getattr(llm, "vllm_config", None), "scheduler_config", None)
        delta = RequestOutputKind.DELTA
        return cls(
            llm, tokenizer, make_params=lambda kw: vllm.SamplingParams(**kw, output_kind=delta),
            context_window=getattr(config, "max_model_len", None) or options.max_model_len or 2048,
            vocab_size=config.get_vocab_size() if config is not None else tokenizer.size,
            max_num_seqs=getattr(scheduler, "max_num_seqs", None) or DEFAULT_MAX_SEQS,
        )

    # -- what the service layer calls ---------------------------------------------------------------
    def check_params(self, params: SamplingParams) -> None:
        """While a request is prepared (before a stream starts): 400 for what vLLM cannot do or refuses."""
        check_supported(params, constrained=False)
        self._vllm_params(params)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        check_supported(request.params, request.constraint is not None)
        params = self._vllm_params(request.params)
        translator = OutputTranslator(request)
        rid = request.request_id
        self._seqs[rid] = request.params.num_seqs
        done = False
        try:
            stream = self.llm.generate({"prompt_token_ids": list(request.prompt_token_ids)}, params, rid,
                                       priority=request.priority)
            async with aclosing(stream) as outputs:
                async for raw in outputs:
                    done = bool(raw.finished)
                    for out in translator.convert(raw):
                        yield out
        except Exception as exc:
            if is_client_error(exc):
                raise InvalidParameter(f"vLLM refused the request: {exc}", None) from None
            raise
        finally:
            self._seqs.pop(rid, None)
            if not done:
                self.abort(rid)

    def _vllm_params(self, params: SamplingParams) -> Any:
        try:
            return self._make_params(sampling_kwargs(params))
        except Exception as exc:
            if is_client_error(exc):
                raise InvalidParameter(f"vLLM refused the sampling parameters: {exc}", None) from None
            raise

    def abort(self, request_id: str) -> None:
        """Stop the request in vLLM (a no-op there if it has finished)."""
        result = self.llm.abort(request_id)
        if not inspect.isawaitable(result):
            return
        try:
            task = asyncio.ensure_future(result)
        except RuntimeError:  # no event loop here: vLLM frees it when the request's generator is closed
            if inspect.iscoroutine(result):
                result.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("aborting a request in vLLM failed: %s", task.exception())

    def stats(self) -> EngineStats:
        """From servelm's side: vLLM's own KV usage is on its /metrics, not here (the KV figures are 0)."""
        seqs = sum(self._seqs.values())
        running = min(seqs, self.max_num_seqs)
        return EngineStats(running=running, waiting=seqs - running, kv_cells_used=0, kv_cells_cached=0,
                           kv_cells_total=0, kv_cell_bytes=0, free_slots=self.max_num_seqs - running, total_slots=self.max_num_seqs)

    # -- lifecycle (Built.start / stop) ---------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not getattr(self.llm, "errored", False)

    def start(self) -> None:
        """Nothing to start: vLLM's output loop starts with the first request, on the server's event loop."""

    def stop(self) -> None:
        shutdown = getattr(self.llm, "shutdown", None) or getattr(self.llm, "shutdown_background_loop", None)
        if shutdown is not None:
            shutdown()


def _hf_tokenizer(llm: Any, options: VllmOptions) -> Any:
    """The Hugging Face tokenizer vLLM uses (recent AsyncLLM has it; older ones wrap it in a TokenizerGroup),
    else the same one loaded with transformers."""
    tok = getattr(llm, "tokenizer", None)
    if tok is not None and not hasattr(tok, "convert_ids_to_tokens"):
        tok = getattr(tok, "tokenizer", None)
    if tok is not None and hasattr(tok, "convert_ids_to_tokens"):
        return tok
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(options.extra.get("tokenizer") or options.model,
                                         trust_remote_code=bool(options.extra.get("trust_remote_code", False)),
                                         revision=options.extra.get("tokenizer_revision"))
