"""Grammars: compile a constraint once, check it, cache it by its text, and hand out matchers.

Every kind of constraint a request can carry (a JSON schema, any JSON object, a regular expression, a
choice among strings, a Lark or GBNF grammar, and the tool-call grammars chat/tools.py writes) becomes
one llguidance grammar string. It is checked against the model's vocabulary here, on the request's own
thread, so a grammar that cannot be compiled is the client's 400 and never an unconstrained answer. The
checked grammar's matcher is kept as a prototype (least recently used out first); each sequence gets a
cheap deep copy of it.

One client's grammar must not exhaust the server (GrammarLimits): compiles run one at a time, each measured
for the heap it takes (glibc's mallinfo2: llguidance allocates through malloc) and the time it takes; a grammar
over either limit is a 400 saying which, and the cache is bounded by the bytes its grammars hold, not by their
count. A compiled grammar is also probed for its first token, so a grammar the engine could not follow (an
alternation past llguidance's per-step limits) is a 400 before any answer starts. llguidance's own failures
come back as one plain sentence, never a Rust panic or a dump of its parser state.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper, regex_to_lark

from servelm import tracing
from servelm.constrain.constraint import Constraint

if TYPE_CHECKING:  # its type stubs only
    from llguidance._lib import JsonCompileOptions

# Compact JSON with the spacing json.dumps writes: no runs of whitespace for a small model to loop in.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SPECIAL_PREFIX = b"\xff"  # llguidance's mark for a control token in the vocabulary table


MiB = 1 << 20


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar, and all the cached ones, may take of the server."""

    max_bytes: int = 64 * MiB  # heap one compiled grammar may hold
    cache_bytes: int = 512 * MiB  # heap the cache of compiled grammars may hold
    max_compile_seconds: float = 5.0  # time one compile may take


class GrammarError(ValueError):
    """The grammar, schema or pattern could not be compiled or is over a limit; the message says why, and `code`
    which (invalid_grammar, grammar_too_large, grammar_too_slow, grammar_too_complex)."""

    def __init__(self, message: str, code: str = "invalid_grammar") -> None:
        super().__init__(message)
        self.code = code


def plain_error(text: str) -> str:
    """llguidance's message as one plain sentence: no Rust panic marker, backtrace or parser-state dump."""
    first = text.split("\n<", 1)[0].split("\nstack backtrace", 1)[0].strip().splitlines()
    line = first[0].strip() if first else "unknown error"
    if line.startswith("panic:"):
        line = "the grammar is larger than the grammar engine can hold (" + line[len("panic:"):].strip() + ")"
    return line[:300]


def _heap_meter() -> Callable[[], int] | None:
    """Bytes in use on the C heap (glibc's mallinfo2), or None where that cannot be read."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    info.restype = MallInfo2

    def used() -> int:
        m = info()
        return int(m.uordblks + m.hblkhd)

    return used


_HEAP = _heap_meter()
# Where the heap cannot be read, a compiled grammar is reckoned at this many bytes per character of its text
# (measured here: 4,000 choices of 8 letters, 52 KB of text, took 3.9 MiB).
_BYTES_PER_CHAR = 80
# llguidance's limits, with its parser state left out of error messages (it can hold the grammar's text)
_PARSER_LIMITS = LLParserLimits(verbose_errors=False)


class _Vocab:
    """The object llguidance's TokenizerWrapper reads: the token table, EOS, and a tokenize function."""

    def __init__(self, table: Sequence[bytes], eos: int, tokenize: Callable[[bytes], list[int]]) -> None:
        self.tokens = list(table)
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = [i for i, t in enumerate(table) if t.startswith(SPECIAL_PREFIX)]
        self._tokenize = tokenize

    def __call__(self, data: bytes) -> list[int]:
        return self._tokenize(data)


class Grammars:
    """One per deployment: the model's vocabulary as llguidance sees it, and the compiled-grammar cache."""

    def __init__(
        self,
        table: Sequence[bytes],
        eog_ids: Iterable[int],
        tokenize: Callable[[bytes], list[int]],
        *,
        limits: GrammarLimits = GrammarLimits(),
    ) -> None:
        eog = [int(t) for t in eog_ids]
        self.tokenizer = LLTokenizer(TokenizerWrapper(_Vocab(table, eog[0], tokenize)), eos_token=eog)
        self.vocab_size = len(table)
        # every token's text with control tokens spelled out (for syntaxes whose markers are control tokens)
        self.spelled = [t[len(SPECIAL_PREFIX):] if t.startswith(SPECIAL_PREFIX) else t for t in table]
        self._specials = {
            t[len(SPECIAL_PREFIX):].decode("utf-8", errors="replace"): i
            for i, t in enumerate(table) if t.startswith(SPECIAL_PREFIX)
        }
        self.limits = limits
        self._cache: OrderedDict[str, tuple[LLMatcher, int]] = OrderedDict()  # key → (prototype, its bytes)
        self._cache_bytes = 0
        self._lock = threading.Lock()
        self._compiling = threading.Lock()  # one compile at a time: bounded memory, and a clean heap measure

    def special_id(self, text: str) -> int | None:
        """The id of the control token whose text this is, if there is one."""
        return self._specials.get(text)

    # -- building constraints ---------------------------------------------------------------------
    def json_schema(self, schema: dict[str, Any] | bool) -> Constraint:
        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema could not be compiled: {exc}") from None
        return self._compile(grammar, "json_schema")

    def json_object(self) -> Constraint:
        return self.json_schema({"type": "object"})

    def regex(self, pattern: str) -> Constraint:
        """The whole output matches the pattern; \\d means an ASCII digit, as users of other servers expect."""
        return self._compile(LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(pattern, 'd')}/"), "regex")

    def choice(self, options: Sequence[str]) -> Constraint:
        """Exactly one of the strings. They form one lexer terminal: a rule of N alternatives would put N items
        in one Earley row, and past 2,000 the parser fails on the first token."""
        if not options:
            raise GrammarError("the choice list is empty")
        lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(o) for o in options)
        return self._compile(LLMatcher.grammar_from_lark(lark), "choice")

    def lark(self, text: str, kind: str = "grammar") -> Constraint:
        """A Lark grammar in llguidance's dialect (which also takes %json{...} schemas inside rules)."""
        return self._compile(LLMatcher.grammar_from_lark(text), kind)

    def grammar(self, text: str) -> Constraint:
        """A grammar as vLLM takes it: Lark, or GBNF/EBNF in llama.cpp's notation (told apart by `::=`)."""
        if "::=" in text:
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                text = any_to_lark(text)
            except Exception as exc:  # the converter raises plain exceptions on bad input
                raise GrammarError(f"the GBNF grammar could not be read: {exc}") from None
        return self.lark(text, "grammar")

    # -- matchers ---------------------------------------------------------------------------------
    def matcher(self, constraint: Constraint) -> LLMatcher:
        """A fresh matcher at the start of the constraint's grammar (a copy of the compiled prototype)."""
        proto: LLMatcher | None = constraint.proto
        if proto is None:  # a constraint that crossed processes (Ray): the cache, else compile it once more
            with self._lock:
                hit = self._cache.get(constraint.key)
                if hit is not None:
                    self._cache.move_to_end(constraint.key)
            proto = hit[0] if hit is not None else self._remember(constraint.key, *self._prototype(constraint.grammar))
        return proto.deep_copy()

    def _compile(self, grammar: str, kind: str) -> Constraint:
        key = hashlib.sha256(grammar.encode()).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        start = time.monotonic()
        proto = hit[0] if hit is not None else self._remember(key, *self._prototype(grammar))
        tracing.event("servelm.grammar_compiled", servelm__grammar_kind=kind, servelm__grammar_cached=hit is not None,
                      servelm__compile_seconds=time.monotonic() - start)
        return Constraint(grammar=grammar, key=key, kind=kind, proto=proto)

    def _prototype(self, grammar: str) -> tuple[LLMatcher, int]:
        """Compile and check a grammar: (its matcher, the heap bytes it holds), or GrammarError."""
        limits = self.limits
        with self._compiling:
            before = _HEAP() if _HEAP is not None else 0
            start = time.monotonic()
            try:
                matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=_PARSER_LIMITS)
            except (ValueError, TypeError, RuntimeError) as exc:
                raise GrammarError(plain_error(str(exc))) from None
            seconds = time.monotonic() - start
            size = _HEAP() - before if _HEAP is not None else len(grammar) * _BYTES_PER_CHAR
        size = max(size, len(grammar))
        if matcher.is_error():
            raise GrammarError(plain_error(matcher.get_error()))
        if size > limits.max_bytes:
            raise GrammarError(f"the compiled grammar needs {size / MiB:.0f} MiB, more than this server's limit of "
                               f"{limits.max_bytes / MiB:.0f} MiB per grammar", "grammar_too_large")
        if seconds > limits.max_compile_seconds:
            raise GrammarError(f"the grammar took {seconds:.1f} s to compile, more than this server's limit of "
                               f"{limits.max_compile_seconds:g} s", "grammar_too_slow")
        self._probe(matcher)
        return matcher, size

    def _probe(self, proto: LLMatcher) -> None:
        """Take the grammar's first step on a copy: a grammar the engine could not follow (a row of alternatives
        past llguidance's per-step limits) is refused now, not found out while the answer is made."""
        m = proto.deep_copy()
        bits = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)  # its own: compiles run on many threads
        m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab_size])
        if m.is_error() or not allowed.size or m.is_stopped():
            return  # nothing this vocabulary can begin with: the engine ends such an answer at once, as before
        if not m.consume_token(int(allowed[0])):
            raise GrammarError(f"the grammar is too complex to follow: {plain_error(m.get_error())}",
                               "grammar_too_complex")

    def _remember(self, key: str, proto: LLMatcher, size: int) -> LLMatcher:
        with self._lock:
            if key not in self._cache:
                self._cache[key] = (proto, size)
                self._cache_bytes += size
            self._cache.move_to_end(key)
            while self._cache_bytes > self.limits.cache_bytes and len(self._cache) > 1:
                _, (_, freed) = self._cache.popitem(last=False)
                self._cache_bytes -= freed
        return proto

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def cached_bytes(self) -> int:
        """Heap bytes the cached grammars hold (as measured when each was compiled)."""
        with self._lock:
            return self._cache_bytes
