"""A Hugging Face tokenizer as the service layer needs it (what llama.cpp's runner gives a LocalEngine
deployment): the chat template, BOS/EOS text, tokenizing with and without special tokens, and each token's
exact bytes (for logprobs' `bytes` and echoed prompts). The vocabulary → bytes translation is pure and tested
without transformers (tests/engine/test_vllm_mapping.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


def _unicode_to_byte() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's), inverted: printable Latin-1 bytes stand for themselves; every
    other byte (controls, space, 0x7F-0xA0, 0xAD) was moved to code point 256 and up, in byte order."""
    own = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in own}
    moved = [b for b in range(256) if b not in set(own)]
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


def byte_level_vocab(pieces: Sequence[str | None]) -> bool:
    """A byte-level BPE vocabulary (GPT-2, Llama 3, Qwen: 'Ġ' is a space) rather than SentencePiece ('▁')."""
    return sum(1 for p in pieces if p and p[0] == "Ġ") > sum(1 for p in pieces if p and p[0] == "▁")


def token_bytes_table(pieces: Sequence[str | None], added: Mapping[int, str], byte_level: bool) -> list[bytes]:
    """Each token's bytes, by id: added and control tokens spelled out, byte-level pieces decoded to their bytes,
    SentencePiece pieces with '▁' as a space and <0xNN> as that byte."""
    decode = _unicode_to_byte() if byte_level else {}
    out: list[bytes] = []
    for i, piece in enumerate(pieces):
        if i in added:
            out.append(added[i].encode())
        elif not piece:
            out.append(b"")
        elif byte_level:
            try:
                out.append(bytes(decode[ch] for ch in piece))
            except KeyError:
                out.append(piece.encode())
        elif m := _BYTE_PIECE.fullmatch(piece):
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append(piece.replace("▁", " ").encode())
    return out


def drop_double_bos(ids: list[int], bos_id: int | None, text: str, bos: str) -> list[int]:
    """A chat template that writes the BOS token itself must not get a second one from the tokenizer."""
    if bos and bos_id is not None and len(ids) > 1 and ids[0] == ids[1] == bos_id and text.startswith(bos):
        return ids[1:]
    return ids


def template_source(value: Any) -> str | None:
    """A tokenizer's chat_template: a string, or (older transformers) named templates: the default one."""
    if isinstance(value, Mapping):
        return value.get("default") or next(iter(value.values()), None)
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


class HfTokenizer:
    """What the service layer needs of the Hugging Face tokenizer vLLM uses for the model (service/registry/deployments'
    Vocabulary), and what the wiring reads of a model's tokenizer (engine/runner.py's ModelVocabulary)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.chat_template = template_source(getattr(tok, "chat_template", None))
        self.bos_token = getattr(tok, "bos_token", None) or ""
        self.eos_token = getattr(tok, "eos_token", None) or ""
        self.bos_id = getattr(tok, "bos_token_id", None)
        decoder = getattr(tok, "added_tokens_decoder", None) or {}
        added = {int(i): getattr(t, "content", str(t)) for i, t in decoder.items()}
        self._special = {text: i for i, text in added.items()}
        pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
        self._bytes = token_bytes_table(pieces, added, byte_level_vocab(pieces))
        self.max_token_bytes = max((len(b) for b in self._bytes), default=1) or 1

    @property
    def size(self) -> int:
        return len(self._bytes)

    def tokenize(self, text: str) -> list[int]:
        """Rendered prompt text → ids, with the tokenizer's BOS and special-token text parsed."""
        return drop_double_bos(list(self._tok.encode(text, add_special_tokens=True)), self.bos_id, text, self.bos_token)

    def tokenize_bare(self, text: str, special: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=not special))

    def token_bytes(self, token: int) -> bytes:
        return self._bytes[token] if 0 <= token < len(self._bytes) else b""

    def special_id(self, text: str) -> int | None:
        return self._special.get(text)
