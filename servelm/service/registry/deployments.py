"""Deployments: the models this server serves, by the name clients put in `model`."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from servelm.chat.markers import ControlMarkers
from servelm.chat.reasoning import ReasoningMarkers
from servelm.chat.template import ChatTemplate
from servelm.chat.tools import HERMES, ToolStyle
from servelm.constrain.grammars import Grammars
from servelm.engine.base import Embedder, Engine
from servelm.engine.wrappers.admission import WaitingQueue
from servelm.errors import InvalidParameter, ModelNotFound
from servelm.service.media import ImageInput
from servelm.service.registry.adapters import AdapterRegistry
from servelm.service.safety.policy import ContentFilter


class Vocabulary(Protocol):
    """A text model's tokenizer, as the services use it."""

    @property
    def size(self) -> int: ...

    @property
    def max_token_bytes(self) -> int:
        """The longest token's text in bytes (control tokens spelled out): text of n bytes is at least n / this
        tokens, which bounds a prompt's length before it is tokenized."""
        ...

    def tokenize(self, text: str) -> list[int]:
        """A rendered prompt → token ids: the BOS the model asks for (once), special-token text parsed."""
        ...

    def tokenize_bare(self, text: str, special: bool) -> list[int]:
        """Text → token ids with nothing added; `special`: whether special-token text is parsed."""
        ...

    def special_id(self, text: str) -> int | None:
        """A control token's id by its text (None: no such token)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """A token's text (control tokens spelled out; b"" outside the vocabulary)."""
        ...


@dataclass(frozen=True)
class ModelFacts:
    """What /v1/models and /health say of a text deployment's model beyond its name: the file's type, the context
    it was trained for, and whether its answers are exact under load (the start-up self-check's finding)."""

    quantization: str | None = None  # Q4_K_M, F16, … (llama.cpp's name for the file's type)
    trained_context: int | None = None
    exact: bool | None = None  # None: not checked (an engine other than ours: vLLM)
    exactness: str = ""  # the self-check's words: "exact (fences: …)", or why not
    prompt_tiles: str = ""  # whether a prompt's whole tiles go on the tiled kernel, and why (compose.settle_tiles)


@dataclass(eq=False, kw_only=True, frozen=True)
class Deployment:
    """A model served by name: what every deployment has, and the embedder of one that answers /v1/embeddings.
    One that generates text is a TextDeployment. Built whole (servelm/compose.py) and never changed: a registry
    that wraps its engine makes a new one (dataclasses.replace)."""

    name: str
    context_window: int  # most tokens one sequence may use: prompt plus completion
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    embedder: Embedder | None = None  # serves POST /v1/embeddings
    max_waiting: int | None = None  # requests that may wait for this deployment (None: the server's default)
    min_priority: int | None = None  # the most urgent priority a request may ask for (None: any)
    queue: WaitingQueue = field(default_factory=WaitingQueue)  # what waits for it now (http/limits.admit)
    # the most memory each part of it may take, in bytes (/health adds them up): the weights, the KV cache, the
    # step's logits rows, the grammar cache, the prefix cache's RAM tier, kept image embeddings, an embedding context
    memory: Mapping[str, int] = field(default_factory=dict)
    placement: str = ""  # where its model's layers run: "CPU", or the GPU and how many of them ("": not known)


@dataclass(eq=False, kw_only=True, frozen=True)
class TextDeployment(Deployment):
    """A deployment that generates text: its engine, chat template and vocabulary, and what shapes its output."""

    engine: Engine
    template: ChatTemplate
    vocab: Vocabulary
    max_choices: int  # n may not exceed the sequences decoded together
    grammars: Grammars | None = None  # constrained output (JSON schemas, grammars, tool calls); None: a 400
    tool_style: ToolStyle = ToolStyle(HERMES, native=False)
    fim_tokens: tuple[int, int, int] | None = None  # fill-in-the-middle (prefix, suffix, middle) token ids
    # control tokens come from the chat template only (chat/markers.py); None: the rendered prompt is tokenized
    # with special tokens parsed, message text included (the opt-in `special_tokens_in_content`, or no vocabulary)
    markers: ControlMarkers | None = None
    bos_id: int | None = None  # the BOS token a prompt begins with, when the model asks for one
    reasoning: ReasoningMarkers | None = None  # a model that thinks between these markers (chat/reasoning.py)
    images: ImageInput | None = None  # reads images in prompts (a vision projector); None: text only
    content_filter: ContentFilter | None = None  # the policy its prompts and answers are checked against
    template_stops: tuple[str, ...] = ()  # stop strings every request gets: the fallback template's end marker
    facts: ModelFacts = ModelFacts()
    adapters: AdapterRegistry | None = None  # its LoRA adapters (a llama.cpp engine's, here or on Ray replicas); None: it takes none


class Deployments:
    """The deployments by name, their aliases, and endpoints that split traffic across several by weight."""

    def __init__(self, deployments: list[Deployment], *, aliases: dict[str, str] | None = None,
                 endpoints: dict[str, list[tuple[str, float]]] | None = None, rng: random.Random | None = None) -> None:
        self._by_name = {d.name: d for d in deployments}
        self._aliases = dict(aliases or {})
        self._endpoints = {name: ([d for d, _ in routes], [w for _, w in routes]) for name, routes in (endpoints or {}).items()}
        self._rng = rng or random.Random()
        self._wrap: Callable[[TextDeployment], Engine] | None = None

    def add(self, deployment: Deployment, aliases: Iterable[str] = ()) -> None:
        """A deployment loaded while serving (servelm/fleet.py), its engine wrapped as with_engines wrapped the
        rest."""
        if isinstance(deployment, TextDeployment) and self._wrap is not None:
            deployment = replace(deployment, engine=self._wrap(deployment))
        self._by_name[deployment.name] = deployment
        self._aliases.update({a: deployment.name for a in aliases})

    def remove(self, name: str) -> None:
        """A deployment being unloaded: requests no longer find it (its aliases stay, answering 404 until it is
        back)."""
        self._by_name.pop(name, None)

    def get(self, model: str) -> Deployment:
        """The deployment that answers `model`: by name, alias, or a weighted draw for an endpoint."""
        name = self._aliases.get(model, model)
        if name in self._endpoints:
            names, weights = self._endpoints[name]
            name = self._rng.choices(names, weights)[0]
        try:
            return self._by_name[name]
        except KeyError:
            based = self.base_of(name)
            if based is None:
                raise ModelNotFound(model) from None
            return based

    def base_of(self, adapter: str) -> TextDeployment | None:
        """The deployment whose LoRA adapter this name is (None: no adapter's)."""
        for d in self.generators():
            if d.adapters is not None and adapter in d.adapters:
                return d
        return None

    def targets(self, model: str) -> list[str]:
        """The deployments a name may reach: itself, an alias's deployment, or every route of an endpoint."""
        name = self._aliases.get(model, model)
        if name in self._endpoints:
            return list(self._endpoints[name][0])
        based = self.base_of(name) if name not in self._by_name else None
        return [based.name] if based is not None else [name] if name in self._by_name else []

    def model_ids(self) -> list[tuple[str, Deployment | None]]:
        """Every name a request may use, with the deployment it names (None for a weighted endpoint)."""
        ids: list[tuple[str, Deployment | None]] = [(d.name, d) for d in self._by_name.values()]
        ids += [(a, self._by_name[n]) for a, n in self._aliases.items() if n in self._by_name]
        ids += [(e, None) for e in self._endpoints]
        return ids

    def generator(self, model: str) -> TextDeployment:
        """The deployment for a text-generating request: 404 if unknown, 400 if it only embeds."""
        d = self.get(model)
        if not isinstance(d, TextDeployment):
            raise InvalidParameter(
                f"The model `{model}` does not generate text: it serves embeddings only (POST /v1/embeddings).",
                "model", code="model_not_supported",
            )
        return d

    def embedder(self, model: str) -> tuple[Deployment, Embedder]:
        """The deployment for an embeddings request and its embedder: 404 if unknown, 400 if it has none."""
        d = self.get(model)
        if d.embedder is None:
            raise InvalidParameter(
                f"The model `{model}` does not produce embeddings.", "model", code="model_not_supported",
            )
        return d, d.embedder

    def all(self) -> list[Deployment]:
        return list(self._by_name.values())

    def all_alive(self) -> bool:
        """Every engine and embedder thread is running (what /health and SageMaker's /ping report)."""
        return all_alive(self._by_name.values())

    def generators(self) -> list[TextDeployment]:
        return [d for d in self._by_name.values() if isinstance(d, TextDeployment)]

    def with_engines(self, wrap: Callable[[TextDeployment], Engine]) -> Deployments:
        """The same names, aliases and endpoints, each text deployment's engine wrapped (http/app.py: metrics and
        the waiting queue around every engine); these deployments stay as they are."""
        wrapped = [replace(d, engine=wrap(d)) if isinstance(d, TextDeployment) else d for d in self._by_name.values()]
        out = Deployments(wrapped, rng=self._rng)
        out._aliases, out._endpoints, out._wrap = self._aliases, self._endpoints, wrap
        return out


def all_alive(deployments: Iterable[Deployment]) -> bool:
    """Every engine and embedder of these deployments is running."""
    for d in deployments:
        if isinstance(d, TextDeployment) and not d.engine.alive or d.embedder is not None and not d.embedder.alive:
            return False
    return True
