"""Grammars: compile a constraint once, check it, cache it by its text, and hand out matchers.

Every kind of constraint a request can carry (a JSON schema, any JSON object, a regular expression, a
choice among strings, a Lark or GBNF grammar, and the tool-call grammars chat/tools.py writes) becomes
one llguidance grammar string. It is checked against the model's vocabulary here, on the request's own
thread, so a grammar that cannot be compiled is the client's 400 and never an unconstrained answer. The
checked grammar's matcher is kept as a prototype (least recently used out first); each sequence gets a
cheap deep copy of it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper, regex_to_lark

from servelm.engine.types import Constraint

# Compact JSON with the spacing json.dumps writes: no runs of whitespace for a small model to loop in.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SPECIAL_PREFIX = b"\xff"  # llguidance's mark for a control token in the vocabulary table


class GrammarError(ValueError):
    """The grammar, schema or pattern could not be compiled; the message says why."""


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
        eog_ids: Sequence[int],
        tokenize: Callable[[bytes], list[int]],
        *,
        cache_size: int = 256,
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
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

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
        if not options:
            raise GrammarError("the choice list is empty")
        lark = "start: " + " | ".join(json.dumps(o) for o in options)
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
        """A fresh matcher at the start of the constraint's grammar (a copy of the cached prototype)."""
        with self._lock:
            proto = self._cache.get(constraint.key)
            if proto is not None:
                self._cache.move_to_end(constraint.key)
        if proto is None:  # evicted since the request was checked: compile it again
            proto = self._prototype(constraint.grammar)
            self._remember(constraint.key, proto)
        return proto.deep_copy()

    def _compile(self, grammar: str, kind: str) -> Constraint:
        key = hashlib.sha256(grammar.encode()).hexdigest()
        with self._lock:
            hit = key in self._cache
            if hit:
                self._cache.move_to_end(key)
        if not hit:
            self._remember(key, self._prototype(grammar))
        return Constraint(grammar=grammar, key=key, kind=kind)

    def _prototype(self, grammar: str) -> LLMatcher:
        try:
            matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(str(exc)) from None
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def _remember(self, key: str, proto: LLMatcher) -> None:
        with self._lock:
            self._cache[key] = proto
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)
