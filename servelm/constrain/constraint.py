"""The constraint a request's output must match: what constrain/ compiles and checks, and the engine carries to
its matchers. A value type that imports nothing of servelm, so that the engine may hold one without constrain/
knowing the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Constraint:
    """A grammar every choice's output must match, compiled and checked by constrain/ before it gets here.

    `grammar` is llguidance's serialized grammar; `key` names it in the compiled-grammar cache; `kind` says
    where it came from (json_schema, json_object, regex, choice, grammar, tools) for logs and errors.
    """

    grammar: str
    key: str
    kind: str
    # Set for "text, or else something that begins with one of these" (tool_choice auto): once the output
    # is text that cannot begin any of them, the grammar allows every continuation, so the engine stops
    # computing its masks.
    free_unless: tuple[str, ...] = ()
    param: str | None = None  # the request parameter it came from, named if it fails while the answer is made
    # The compiled, checked grammar (an llguidance matcher to copy), so that the engine never compiles on its
    # own thread. Process-local: not pickled (a Ray replica compiles from `grammar` once, then caches it).
    proto: Any = field(default=None, compare=False, repr=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Constraint, (self.grammar, self.key, self.kind, self.free_unless, self.param))


