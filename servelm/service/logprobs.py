"""Engine logprobs → the wire's logprobs objects.

The chat form (OpenAI's) gives each token's text, logprob, UTF-8 bytes and most likely alternatives. A
logprob must be given for the token taken even when it is not among the 20 most likely; the seeds' rule is
that such a token's logprob is reported as -9999.0. The legacy completions form gives every token's true
logprob (scoring a prompt with `echo` sums them), as does vLLM's `prompt_logprobs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from servelm.engine.types import TokenLogprob
from servelm.errors import ServerError

UNLIKELY = -9999.0
TOP_RANKS = 20


def token_text(data: bytes) -> str:
    """A token's text; a token holding part of a UTF-8 character shows it as U+FFFD (bytes has it exactly)."""
    return data.decode("utf-8", errors="replace")


def reported(logprob: float, rank: int) -> float:
    return logprob if rank <= TOP_RANKS and logprob != float("-inf") else UNLIKELY


def true_logprob(logprob: float) -> float:
    """The legacy form's value: the token's true logprob whatever its rank (lm-evaluation-harness sums them to
    score a text), -9999.0 only for a token that could not be taken at all (-inf has no JSON form)."""
    return logprob if math.isfinite(logprob) else UNLIKELY


def vllm_prompt_logprobs(prompt: Sequence[int], entries: Sequence[TokenLogprob | None] | None,
                         token_bytes: Callable[[int], bytes]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), a map from token id to its logprob, rank
    and text, holding the prompt's own token and the k most likely."""
    if entries is None or len(entries) != len(prompt):
        raise ServerError("The engine did not report the prompt's logprobs.")
    out: list[dict[str, dict[str, Any]] | None] = []
    for token, e in zip(prompt, entries):
        if e is None:
            out.append(None)
            continue
        ranked = {token: (e.logprob, e.rank)}
        for rank, (t, lp) in enumerate(e.top, start=1):
            ranked.setdefault(t, (lp, rank))
        out.append({str(t): {"logprob": true_logprob(lp), "rank": rank, "decoded_token": token_text(token_bytes(t))}
                    for t, (lp, rank) in ranked.items()})
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    content = []
    for e in entries:
        data = token_bytes(e.token)
        content.append({
            "token": token_text(data),
            "logprob": reported(e.logprob, e.rank),
            "bytes": list(data),
            "top_logprobs": [
                {"token": token_text(b), "logprob": lp, "bytes": list(b)}
                for b, lp in ((token_bytes(t), lp) for t, lp in e.top)
            ],
        })
    return {"content": content, "refusal": None}


def legacy_logprobs(
    tokens: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    token_bytes: Callable[[int], bytes],
    offset: int = 0,
    text_len: int | None = None,
    zero_width: int = 0,
) -> tuple[dict[str, Any], int]:
    """The legacy completions form: parallel lists of token texts, logprobs, top alternatives and character
    offsets. `entries[i]` belongs to `tokens[i]`; None (a prompt's first token) has no logprob. Offsets
    count from `offset` (the text before these tokens) and never pass `text_len` (a stop string cut off the
    end of a token's text); the first `zero_width` tokens (a BOS the tokenizer added) stand at `offset` and take no
    characters, since the text they precede does not hold them. Each top dict lists the k most likely tokens and
    always the token taken (OpenAI: up to logprobs + 1 entries). Returns the object and the offset after the last
    token."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, (token, e) in enumerate(zip(tokens, entries)):
        text = token_text(token_bytes(token))
        out["tokens"].append(text)
        out["text_offset"].append(offset if text_len is None else min(offset, text_len))
        offset += len(text) if i >= zero_width else 0
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        logprob = true_logprob(e.logprob)
        top: dict[str, float] = {}
        for t, lp in e.top:
            top.setdefault(token_text(token_bytes(t)), lp)
        top.setdefault(text, logprob)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
    return out, offset
