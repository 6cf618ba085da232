"""Deployments: the models this server serves, by the name clients put in `model`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from servelm.chat.template import ChatTemplate
from servelm.chat.tools import HERMES, ToolStyle
from servelm.constrain.grammars import Grammars
from servelm.engine.base import Engine
from servelm.errors import ModelNotFound


@dataclass(eq=False)
class Deployment:
    name: str
    engine: Engine
    template: ChatTemplate
    tokenize: Callable[[str], list[int]]  # rendered prompt text → token ids (special tokens parsed)
    context_window: int  # most tokens one sequence may use: prompt plus completion
    vocab_size: int
    max_choices: int  # n may not exceed the sequences decoded together
    fingerprint: str
    grammars: Grammars | None = None  # constrained output (JSON schemas, grammars, tool calls)
    tool_style: ToolStyle = ToolStyle(HERMES, native=False)
    special_id: Callable[[str], int | None] = lambda _text: None  # a control token's id by its text
    created: int = field(default_factory=lambda: int(time.time()))


class Deployments:
    def __init__(self, deployments: list[Deployment]) -> None:
        self._by_name = {d.name: d for d in deployments}

    def get(self, model: str) -> Deployment:
        try:
            return self._by_name[model]
        except KeyError:
            raise ModelNotFound(model) from None

    def all(self) -> list[Deployment]:
        return list(self._by_name.values())
