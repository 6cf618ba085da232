"""From deployment specs to running parts: each chat deployment gets a llama.cpp runner, a LocalEngine and
(optionally) an embedding context on the same weights; each embedding deployment gets an EmbeddingEngine; a
chat deployment with `engine = "vllm"` gets a VllmEngine on a GPU (vLLM is imported only then).

The specs come from the config file (`--config`), or, without one, from the command line's single model and
the embedded embedding model (`default_specs`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from servelm import __version__
from servelm.chat.reasoning import THINK, ReasoningMarkers
from servelm.config import (
    ContentFilterSpec,
    DeploymentSpec,
    EndpointSpec,
    EngineSettings,
    LoraSpec,
    McpServerSpec,
    ServerSettings,
    load_config_file,
)
from servelm.constrain.grammars import GrammarLimits, Grammars, MiB
from servelm.engine.base import Embedder, Engine
from servelm.engine.pacing import StepPacer
from servelm.engine.plan import max_logits_rows
from servelm.engine.runner import ModelInfo, ModelVocabulary, ServedRunner
from servelm.engine.spill import SpillStore
from servelm.engine.wrappers.adapted import AdaptedEngine
from servelm.keys import KeySpec, load_keys
from servelm.models import resolve_model_source
from servelm.service.media import ImageInput, ImageSources
from servelm.service.registry.adapters import AdapterRegistry, Adapters
from servelm.service.registry.deployments import Deployment, Deployments, ModelFacts, TextDeployment
from servelm.service.safety.content_filter import check_guard

if TYPE_CHECKING:
    from servelm.chat.template import ChatTemplate
    from servelm.engine.embedding import EmbeddingEngine, EmbeddingModel
    from servelm.engine.local import LocalEngine
    from servelm.service.safety.policy import ContentFilter
    from servelm.tracing import TraceSettings

log = logging.getLogger("servelm")
EMBEDDING_SEQS = 64  # inputs one embedding pass may carry
EMBEDDING_WINDOW = 2048  # most tokens per input (and per pass) of an embedding model: attention is quadratic in it
EMBEDDING_CONTEXT_BYTES = 128 << 20  # an embedding context's own buffers, at most (its cache and compute graph)


@dataclass(frozen=True)
class DeploymentOptions:
    """A deployment's settings as compose uses them, read once from its spec (`of`): its engine's (the defaults are
    a test's: no inter-token target), its model's text (a chat template's text, control tokens, reasoning markers),
    its LoRA adapters, where its images may come from, its waiting bound, priority bound and content policy."""

    prefix_cache: bool = True
    speculative: bool = True  # draft-free speculative decoding (n-grams)
    itl_target_s: float = 0.0  # the inter-token target while prompts arrive (0: none)
    prompt_tiles: str = "auto"  # a prompt's whole tiles on the tiled kernel: auto (where one fits the target), on, off
    fair_share: bool = True  # the next free slot to the tenant served least (engine/fairness.py)
    priority_aging_s: float = 60.0
    grammar_limits: GrammarLimits = GrammarLimits()
    max_loras: int = 8  # LoRA adapters loaded at once
    loras: tuple[LoraSpec, ...] = ()  # adapters loaded at start
    chat_template: str | None = None  # a template's text (None: the model file's)
    special_tokens_in_content: bool = False
    reasoning_markers: str = "auto"
    image_sources: ImageSources = ImageSources()
    max_waiting: int | None = None  # None: the server's --max-waiting
    min_priority: int | None = None
    content_filter: ContentFilter | None = None
    fingerprint_source: str = ""  # what the fingerprint is made of (its model file's name and size; "": the model's description)

    @classmethod
    def of(cls, spec: DeploymentSpec, images: ImageSources = ImageSources(), fingerprint_source: str = "") -> DeploymentOptions:
        """A spec's options (its chat template file read, its content policy's lists read)."""
        e = spec.engine
        return cls(prefix_cache=e.prefix_cache, speculative=e.speculative == "ngram", itl_target_s=e.itl_target_ms / 1000,
                   prompt_tiles=e.prompt_tiles, fair_share=e.fair_share, priority_aging_s=e.priority_aging_s, grammar_limits=grammar_limits(e), max_loras=e.max_loras,
                   loras=tuple(spec.loras),
                   chat_template=spec.chat_template.read_text(encoding="utf-8") if spec.chat_template else None,
                   special_tokens_in_content=spec.special_tokens_in_content, reasoning_markers=spec.reasoning_markers,
                   image_sources=images, max_waiting=spec.limits.max_waiting, min_priority=spec.limits.min_priority,
                   content_filter=content_filter_of(spec.content_filter), fingerprint_source=fingerprint_source)


@dataclass(frozen=True)
class Serving:
    """What serves a text deployment, as text_deployment takes it: the engine (a runner's LocalEngine behind its
    adapters, or Ray replicas), what it says of the model it runs (fingerprint, context window, sequences decoded
    together, the self-check's facts, placement), and its LoRA adapters, image reader, embedder and memory."""

    engine: Engine
    fingerprint: str
    context_window: int
    max_choices: int
    facts: ModelFacts = ModelFacts()
    placement: str = ""
    adapters: AdapterRegistry | None = None
    images: ImageInput | None = None
    embedder: Embedder | None = None
    memory: Mapping[str, int] = field(default_factory=dict)


def cuda_note(name: str, placement: str, env: Mapping[str, str]) -> str | None:
    """What the log says when SERVELM_CUDA=1 asks for a GPU and the model runs on the CPU (None otherwise)."""
    if env.get("SERVELM_CUDA", "").strip() != "1" or placement != "CPU":
        return None
    return (f"SERVELM_CUDA=1 is set, but {name} runs on the CPU: llama.cpp finds no GPU here (its build has no CUDA "
            "backend, or no GPU is present), so the CPU build is served. SERVELM_CUDA chooses the build at install "
            "time (make install); --n-gpu-layers places the layers")


def settle_tiles(name: str, runner: ServedRunner, options: DeploymentOptions) -> str:
    """Whether the runner reads a prompt's whole tiles on its tiled kernel, decided once, before anything is read or
    cached (its state fingerprint says which): --prompt-tiles, and for auto whether the self-check's timed tile pass
    takes at most half the inter-token target, since a decoding step that reads a tile takes that pass whole. Returns
    what /v1/models and /health say of it ("" for a runner without tiles: a GPU, or an inexact tiled kernel)."""
    if not runner.tile_rows:
        return ""
    target = options.itl_target_s * 1000
    took = f"a tile's pass takes {runner.tile_seconds * 1000:.0f} ms" if runner.tile_seconds else \
        "a tile's pass was not timed: the self-check times one where the context holds two tiles"
    # not timed (a context of under two tiles): nothing says it fits
    fits = not target or 0 < runner.tile_seconds * 1000 <= target / 2
    if options.prompt_tiles == "off":
        keep, words = False, "off (--prompt-tiles off)"
    elif options.prompt_tiles == "on":
        keep, words = True, f"on (--prompt-tiles on; {took}" + (
            "" if fits else f", so a decoding stream may wait that long, past --itl-target-ms {target:.0f}") + ")"
    elif fits:
        keep, words = True, f"on ({took}" + (f", within half of --itl-target-ms {target:.0f})" if target else ")")
    else:
        keep, words = False, f"off ({took}, more than half of --itl-target-ms {target:.0f}; --prompt-tiles on reads them)"
    if not keep:
        runner.tile_rows = 0
    log.info("%s: a prompt's whole tiles on the tiled kernel: %s", name, words)
    return words


def build_deployment(name: str, runner: ServedRunner, options: DeploymentOptions = DeploymentOptions(), *,
                     spill: SpillStore | None = None, grammars: Grammars | None = None,
                     embedder: Embedder | None = None, tiles: str = "") -> tuple[TextDeployment, LocalEngine]:
    """A runner's LocalEngine (not started) and the deployment it serves, built whole: its LoRA adapters (the
    options' loaded at start), images when the runner has a projector, `embedder` answering its embeddings, `spill`
    its prefix cache's lower tiers. `grammars` given: its model's vocabulary's, built before (GrammarPool's). `tiles`:
    what settle_tiles said."""
    from servelm.engine.local import LocalEngine

    model = runner.model
    grammars = grammars or grammars_of(model, options.grammar_limits)
    pacer = StepPacer(options.itl_target_s) if options.itl_target_s > 0 else None
    engine = LocalEngine(runner, prefix_cache=options.prefix_cache, grammars=grammars, speculative=options.speculative,
                         spill=spill, pacer=pacer, priority_aging_s=options.priority_aging_s,
                         fair_share=options.fair_share)
    adapters = Adapters(engine, options.max_loras)
    for lora in options.loras:
        adapters.add_at_start(lora.name, str(lora.path), lora.scale)
    exactness = runner.exactness
    projector = getattr(runner, "projector", None)  # a vision projector: images in prompts
    memory = {
        "weights": model.weights_bytes, "kv_cache": runner.kv_cells * runner.kv_cell_bytes,
        "logits": (min(runner.max_step_tokens, max_logits_rows(runner.num_slots)) + 1) * runner.vocab_size * 4,
        "grammar_cache": grammars.limits.cache_bytes,
        "prefix_cache_ram": spill.ram_bytes if spill is not None else 0,
        "image_embeddings": projector.kept_bytes_max if projector is not None else 0,
    }
    serving = Serving(
        AdaptedEngine(engine, adapters), _fingerprint(options.fingerprint_source or model.description),
        runner.context_window, runner.num_slots,
        facts=ModelFacts(quantization=model.quantization, trained_context=model.trained_context,
                         exact=exactness.exact if exactness.checked else None, exactness=exactness.describe(),
                         prompt_tiles=tiles),
        placement=getattr(runner, "placement", ""), adapters=adapters, embedder=embedder, memory=memory,
        images=ImageInput(projector, options.image_sources) if projector is not None else None,
    )
    return text_deployment(name, model, grammars, options, serving), engine


def text_deployment(name: str, model: ModelInfo, grammars: Grammars, options: DeploymentOptions,
                    serving: Serving) -> TextDeployment:
    """A text deployment of a model (its vocabulary, chat template and control tokens, as `options` say) that
    `serving` says serves it: a LocalEngine on its runner (build_deployment), or servelm/ray's ingress's replicas,
    whose model the ingress loads vocabulary-only."""
    from servelm.chat.markers import ControlMarkers, ControlToken
    from servelm.chat.template import CHATML_END
    from servelm.chat.tools import detect_style

    template = template_of(name, model, options.chat_template)
    template_source = template.source if template.origin != "fallback" else None
    controls = None if options.special_tokens_in_content else model.control_tokens()
    return TextDeployment(
        name=name,
        engine=serving.engine,
        template=template,
        template_stops=(CHATML_END,) if template.origin == "fallback" else (),
        facts=serving.facts,
        vocab=ServiceVocabulary(model, grammars),
        context_window=serving.context_window,
        max_choices=serving.max_choices,
        fingerprint=serving.fingerprint,
        grammars=grammars,
        tool_style=detect_style(template_source),
        fim_tokens=model.fim_tokens,
        reasoning=reasoning_of(options.reasoning_markers, template_source),
        placement=serving.placement,
        markers=ControlMarkers([ControlToken(*c) for c in controls]) if controls is not None else None,
        bos_id=model.bos_id if controls is not None else None,
        adapters=serving.adapters,
        images=serving.images,
        embedder=serving.embedder,
        memory=serving.memory,
        max_waiting=options.max_waiting,
        min_priority=options.min_priority,
        content_filter=options.content_filter,
    )


def grammars_of(model: ModelInfo, limits: GrammarLimits) -> Grammars:
    """A model's vocabulary's Grammars (constrained output over its tokens)."""
    return Grammars(model.token_table(), model.eog_ids, model.tokenize_text, limits=limits)


def template_of(name: str, model: ModelInfo, file_template: str | None) -> ChatTemplate:
    """A deployment's chat template: --chat-template's file, else the model file's, else llama.cpp's built-in one
    for the model's architecture, else ChatML (the last two with a start-up warning)."""
    from servelm.chat.template import BuiltinTemplate, ChatTemplate

    if file_template:
        return ChatTemplate(file_template, bos_token=model.bos_token, eos_token=model.eos_token, origin="file")
    if model.chat_template:
        return ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    builtin = model.builtin_template()
    if builtin is not None:
        log.warning("%s: the model file has no chat template (tokenizer.chat_template); using llama.cpp's built-in "
                    "%r template for its architecture (give --chat-template to use another)", name, builtin)
        return BuiltinTemplate(builtin, model.apply_builtin_template)
    log.warning("%s: the model file has no chat template (tokenizer.chat_template) and llama.cpp has none for its "
                "architecture; using ChatML, whose end marker <|im_end|> also stops answers. Give --chat-template "
                "with the model's own template", name)
    return ChatTemplate(None, bos_token=model.bos_token, eos_token=model.eos_token)


class _Tokenize:
    """A pooled Grammars' tokenize function: the model it serves now; none while the Grammars waits in the pool
    (its model closed)."""

    def __init__(self) -> None:
        self.model: Callable[[bytes], list[int]] | None = None

    def __call__(self, data: bytes) -> list[int]:
        if self.model is None:
            raise RuntimeError("the model of these grammars is unloaded")
        return self.model(data)


class GrammarPool:
    """The Grammars of unloaded models, kept for their next load. llguidance builds a vocabulary's tokenizer (its
    token trie and slices) in one call that holds the GIL: about 0.15 s for SmolLM2's 49,152 tokens on an idle
    core, a second on a busy machine, and every thread of the server, the event loop's first, waits that long. A
    model loaded again (an unload and a load, a wake after keep_alive) takes its vocabulary's Grammars from here
    instead. At most KEPT are kept (about 18 MiB each for a 49k vocabulary), each with at most KEPT_CACHE_BYTES of
    compiled grammars; a Grammars serves one deployment at a time."""

    KEPT = 4
    KEPT_CACHE_BYTES = 64 << 20

    def __init__(self) -> None:
        self._idle: OrderedDict[tuple[str, GrammarLimits], tuple[Grammars, _Tokenize]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, model: ModelInfo, limits: GrammarLimits) -> tuple[Grammars, _PoolReturn]:
        """The model's vocabulary's Grammars (one kept, else a new one), and the closer that gives it back."""
        table = model.token_table()
        digest = hashlib.sha256()
        for token in table:
            digest.update(len(token).to_bytes(4, "little"))
            digest.update(token)
        for t in model.eog_ids:
            digest.update(int(t).to_bytes(8, "little", signed=True))
        key = (digest.hexdigest(), limits)
        with self._lock:
            kept = self._idle.pop(key, None)
        grammars, tokenize = kept or (None, _Tokenize())
        tokenize.model = model.tokenize_text
        if grammars is None:
            grammars = Grammars(table, model.eog_ids, tokenize, limits=limits)
        return grammars, _PoolReturn(self, key, grammars, tokenize)

    def give_back(self, key: tuple[str, GrammarLimits], grammars: Grammars, tokenize: _Tokenize) -> None:
        tokenize.model = None
        if grammars.cached_bytes() > self.KEPT_CACHE_BYTES:
            return
        with self._lock:
            self._idle[key] = (grammars, tokenize)
            while len(self._idle) > self.KEPT:
                self._idle.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()


@dataclass(eq=False)
class _PoolReturn:
    """A Built's closer (before its runner's): the deployment's Grammars back to the pool, once."""

    pool: GrammarPool
    key: tuple[str, GrammarLimits]
    grammars: Grammars | None
    tokenize: _Tokenize

    def close(self) -> None:
        grammars, self.grammars = self.grammars, None
        if grammars is not None:
            self.pool.give_back(self.key, grammars, self.tokenize)


GRAMMARS = GrammarPool()


def build_embedding_deployment(name: str, model: EmbeddingModel, options: DeploymentOptions = DeploymentOptions(),
                               memory: Mapping[str, int] | None = None) -> tuple[Deployment, EmbeddingEngine]:
    """An embedding-only deployment over an embedding model (its EmbeddingEngine is not started), built whole:
    `memory` is what each part may take."""
    from servelm.engine.embedding import EmbeddingEngine

    embedder = EmbeddingEngine(model)
    deployment = Deployment(name=name, context_window=embedder.context_window,
                            fingerprint=_fingerprint(options.fingerprint_source or name), embedder=embedder,
                            placement=getattr(model, "placement", ""), memory=memory or {},
                            max_waiting=options.max_waiting, min_priority=options.min_priority)
    return deployment, embedder


class ServiceVocabulary:
    """A model's vocabulary as the services use it (service/registry/deployments.Vocabulary): tokenizing by the model,
    control tokens and token texts from the grammars' table (one spelling for both)."""

    def __init__(self, model: ModelInfo, grammars: Grammars) -> None:
        self._model, self._grammars = model, grammars
        self.size = model.vocab_size
        self.max_token_bytes = max((len(b) for b in grammars.spelled), default=1) or 1

    def tokenize(self, text: str) -> list[int]:
        ids = self._model.tokenize(text, add_special=True, parse_special=True)
        bos = self._model.bos_token
        # a template that writes the BOS token itself must not get a second one from the tokenizer
        if bos and len(ids) > 1 and ids[0] == ids[1] and text.startswith(bos):
            ids = ids[1:]
        return ids

    def tokenize_bare(self, text: str, special: bool) -> list[int]:
        return self._model.tokenize(text, add_special=False, parse_special=special)

    def special_id(self, text: str) -> int | None:
        return self._grammars.special_id(text)

    def token_bytes(self, token: int) -> bytes:
        spelled = self._grammars.spelled
        return spelled[token] if 0 <= token < len(spelled) else b""


def reasoning_of(setting: str, template_source: str | None) -> ReasoningMarkers | None:
    """A deployment's reasoning markers: "auto" reads `<think>…</think>` when its chat template speaks of them,
    "none" reads none, "OPEN,CLOSE" reads that pair."""
    if setting == "none":
        return None
    if setting == "auto":
        return ReasoningMarkers(*THINK) if template_source and THINK[0] in template_source else None
    return ReasoningMarkers.parse(setting)


def content_filter_of(spec: ContentFilterSpec | None) -> ContentFilter | None:
    """A deployment's content policy from its config (its lists read, its guard's template read)."""
    from servelm.service.safety.blocklist import Blocklist
    from servelm.service.safety.policy import LLAMA_GUARD_LABELS, LLAMA_GUARD_TEMPLATE, ContentFilter, Guard, GuardLabel, Rule

    if spec is None:
        return None
    lists = [Blocklist.read(path, whole_words=spec.whole_words) for path in spec.blocklist]
    if spec.terms:
        lists.append(Blocklist(spec.terms, "terms", whole_words=spec.whole_words))
    guard = None
    if spec.guard is not None:
        g = spec.guard
        labels = tuple(GuardLabel(lab.label, lab.name, lab.category) for lab in g.labels) if g.labels \
            else LLAMA_GUARD_LABELS
        template = g.template.read_text(encoding="utf-8") if g.template else LLAMA_GUARD_TEMPLATE
        guard = Guard(g.deployment, template, labels, g.timeout, g.max_tokens)
    rules = {name: Rule(rule.action, rule.severity) for name, rule in spec.rules().items()}
    return ContentFilter(input=spec.input, output=spec.output, window=spec.window, lists=lists, guard=guard,
                         rules=rules, fail_open=spec.on_guard_error == "open", blocked_message=spec.blocked_message)


def with_blocklist(specs: list[DeploymentSpec], blocklist: Path | None) -> list[DeploymentSpec]:
    """`--content-blocklist FILE`: the file's terms blocked in every chat deployment's prompts and answers (added
    to a policy a deployment has, else its policy)."""
    if blocklist is None:
        return specs
    out = []
    for spec in specs:
        if spec.kind == "chat":
            policy = spec.content_filter or ContentFilterSpec(blocklist=[blocklist])
            if blocklist not in policy.blocklist:
                policy = policy.model_copy(update={"blocklist": [*policy.blocklist, blocklist]})
            spec = spec.model_copy(update={"content_filter": policy})
        out.append(spec)
    return out


def check_guards(deployments: Deployments) -> None:
    """Every policy's guard names a deployment that can judge (a ValueError saying which cannot)."""
    for d in deployments.generators():
        if d.content_filter is not None:
            check_guard(d.content_filter, deployments)


def grammar_limits(e: EngineSettings) -> GrammarLimits:
    """A deployment's EngineSettings → the GrammarLimits of its grammars."""
    return GrammarLimits(max_bytes=e.grammar_max_mib * MiB, cache_bytes=e.grammar_cache_mib * MiB,
                         max_compile_seconds=e.grammar_compile_ms / 1000)


def _fingerprint(source: str) -> str:
    return "fp_" + hashlib.sha256(f"{__version__}:{source}".encode()).hexdigest()[:10]


def default_specs(settings: ServerSettings) -> list[DeploymentSpec]:
    """Without a config file: the chat model of --model-path / --model-id, and the embedding model."""
    specs = [DeploymentSpec(
        name=settings.resolved_model_id(), model=str(settings.resolved_model_path()), kind="chat",
        chat_template=settings.chat_template, embedding_window=settings.chat_embedding_window, engine=settings.engine,
        special_tokens_in_content=settings.special_tokens_in_content, reasoning_markers=settings.reasoning_markers,
        mmproj=settings.mmproj, loras=[LoraSpec.parse(text) for text in settings.lora],
    )]
    path = settings.resolved_embedding_model_path()
    if path is not None:
        specs.append(DeploymentSpec(name=settings.embedding_model_id, model=str(path), kind="embedding",
                                    engine=settings.engine))
    elif settings.embedding_model and settings.embedding_model_path is None:
        log.warning("the embedding model is not installed (run `make install`); serving no %r",
                    settings.embedding_model_id)
    if settings.rerank_model_path:
        path = Path(settings.rerank_model_path)
        specs.append(DeploymentSpec(name=settings.rerank_model_id or path.stem, model=str(path), kind="rerank",
                                    engine=settings.engine))
    return specs


class Worker(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


class Closer(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True)
class Built:
    deployments: Deployments
    workers: Sequence[Worker] = ()  # started with the app, stopped with it
    closers: Sequence[Closer] = ()  # llama.cpp objects to close after serving, in order

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def close(self) -> None:
        for c in self.closers:
            c.close()


def image_sources(settings: ServerSettings) -> ImageSources:
    """Where the server fetches images from, and how much (its --allowed-media-domains and limits)."""
    return ImageSources(tuple(d.lower().strip(".") for d in settings.allowed_media_domains), settings.max_image_bytes,
                        settings.media_fetch_timeout)


@dataclass
class _Parts:
    """What a build has made so far: closed in reverse of need when a later model fails to load."""

    deployments: list[Deployment] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    embedders: list[Closer] = field(default_factory=list)  # closed before the runners whose weights they share
    runners: list[Closer] = field(default_factory=list)


@dataclass(frozen=True)
class Builder:
    """Deployment specs → their running parts (a Built): the one way every entry point loads models (`servelm
    serve`, --ray's replicas, `servelm batch`, the models loaded on demand). Its settings are the server's:
    llama.cpp's own log lines, where images may come from, and the --content-blocklist every chat deployment gets."""

    verbose_llama: bool = False
    images: ImageSources = ImageSources()
    blocklist: Path | None = None
    check_memo: Path | None = None  # where the self-checks' findings are kept (None: every load checks)

    def build(self, specs: Sequence[DeploymentSpec], endpoints: Sequence[EndpointSpec] = ()) -> Built:
        """Load every deployment's model (several models run in one server, each with its own engine)."""
        specs = with_blocklist(list(specs), self.blocklist)
        parts = _Parts()
        try:
            for spec in specs:
                if spec.kind == "chat" and spec.backend == "vllm":
                    self._vllm(spec, parts)
                elif spec.kind == "chat":
                    self._chat(spec, parts)
                else:
                    self._embedding(spec, parts)
        except BaseException:
            for c in (*parts.embedders, *parts.runners):
                c.close()
            raise
        aliases = {a: s.name for s in specs for a in s.aliases}
        routes = {e.name: [(r.deployment, r.weight) for r in e.routes] for e in endpoints}
        built = Built(Deployments(parts.deployments, aliases=aliases, endpoints=routes), parts.workers,
                      [*parts.embedders, *parts.runners])
        try:
            check_guards(built.deployments)
        except BaseException:
            built.close()
            raise
        return built

    def one(self, spec: DeploymentSpec) -> Built:
        """One deployment's parts (a model loaded on demand, a Ray replica's)."""
        return self.build([spec])

    def _chat(self, spec: DeploymentSpec, parts: _Parts) -> None:
        from servelm.engine.embedding import EmbeddingEngine
        from servelm.runners.llamacpp import LlamaCppEmbedder, load_exact

        path = resolve_model_source(spec.model, "chat")
        e = spec.engine
        log.info("loading %s for %r", path, spec.name)
        runner = load_exact(
            path, num_slots=e.max_num_seqs, max_step_tokens=max(e.max_step_tokens, e.max_num_seqs),
            context_window=e.context_window, kv_budget_mib=e.kv_budget_mib, threads=e.threads,
            verbose=self.verbose_llama, mmproj=spec.mmproj, kv_cache_type=e.kv_cache_type, gpu_layers=e.n_gpu_layers,
            main_gpu=e.main_gpu, memo_dir=self.check_memo,
        )
        if (note := cuda_note(spec.name, runner.placement, os.environ)) is not None:
            log.warning("%s", note)
        options = DeploymentOptions.of(spec, self.images, f"{path.name}:{path.stat().st_size}")
        grammars, give_back = GRAMMARS.take(runner.model, options.grammar_limits)
        parts.runners.extend((give_back, runner))  # closed in this order: the grammars detached before the runner goes
        embedder = None
        if spec.embedding_window:
            window = min(spec.embedding_window, runner.context_window)
            ctx = LlamaCppEmbedder(share=runner, pooling="mean", window=window, max_seqs=EMBEDDING_SEQS, threads=e.threads,
                                   lazy=True)  # made at the first embeddings request
            parts.embedders.append(ctx)
            embedder = EmbeddingEngine(ctx)
        tiles = settle_tiles(spec.name, runner, options)  # before the fingerprint: the cells depend on it
        deployment, engine = build_deployment(spec.name, runner, options, spill=spill_store(e, runner.state_fingerprint),
                                              grammars=grammars, embedder=embedder, tiles=tiles)
        parts.workers.extend((engine, embedder) if embedder is not None else (engine,))
        parts.deployments.append(deployment)

    def _vllm(self, spec: DeploymentSpec, parts: _Parts) -> None:
        """A chat deployment on vLLM (a GPU): vLLM's engine, servelm's API. servelm's grammars do not run there, so
        the deployment has none (constrained output and tools are a 400), and it answers no embeddings."""
        from servelm.chat.template import ChatTemplate
        from servelm.chat.tools import detect_style
        from servelm.config import VllmSettings
        from servelm.engine.vllm import VllmEngine, VllmOptions  # imports vllm itself only when it builds the engine

        v = spec.vllm or VllmSettings()
        options = VllmOptions(model=v.model or spec.model, tensor_parallel_size=v.tensor_parallel_size,
                              gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=v.max_model_len,
                              dtype=v.dtype, extra=dict(v.engine_args))
        log.info("loading %s into vLLM for %r", options.model, spec.name)
        engine = VllmEngine.create(options)
        tok: ModelVocabulary = engine.tokenizer  # a Hugging Face tokenizer (engine/hf_vocab.py): its template, BOS, EOS
        parts.deployments.append(TextDeployment(
            name=spec.name,
            engine=engine,
            template=ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token),
            vocab=engine.tokenizer,
            context_window=engine.context_window,
            max_choices=engine.max_num_seqs,
            fingerprint=_fingerprint(f"vllm:{options.model}"),
            tool_style=detect_style(tok.chat_template),
            reasoning=reasoning_of(spec.reasoning_markers, tok.chat_template),
            max_waiting=spec.limits.max_waiting,
            min_priority=spec.limits.min_priority,
            content_filter=content_filter_of(spec.content_filter),
        ))
        parts.workers.append(engine)

    def _embedding(self, spec: DeploymentSpec, parts: _Parts) -> None:
        from servelm.runners.llamacpp import LlamaCppEmbedder

        path = resolve_model_source(spec.model, "embedding")
        log.info("loading %s for %r", path, spec.name)
        model = LlamaCppEmbedder(path, window=EMBEDDING_WINDOW, max_seqs=EMBEDDING_SEQS, threads=spec.engine.threads,
                                 verbose=self.verbose_llama, pooling="rank" if spec.kind == "rerank" else None,
                                 gpu_layers=spec.engine.n_gpu_layers, main_gpu=spec.engine.main_gpu)
        parts.embedders.append(model)
        log.info("%s runs on %s", path.name, model.placement)
        size = path.stat().st_size
        options = DeploymentOptions(max_waiting=spec.limits.max_waiting, min_priority=spec.limits.min_priority,
                                    fingerprint_source=f"{path.name}:{size}")
        deployment, engine = build_embedding_deployment(
            spec.name, model, options, memory={"weights": size, "embedding_context": EMBEDDING_CONTEXT_BYTES})
        parts.workers.append(engine)
        parts.deployments.append(deployment)


def spill_store(e: EngineSettings, fingerprint: str) -> SpillStore | None:
    """Where a deployment's prefix-cache entries go when its slots give them up (none without the prefix cache).
    Only an f16 KV cache spills: a quantized one's restored entries did not answer exactly as computed ones under
    load (tests/e2e/test_exactness.py), so there entries are dropped as before."""
    if not e.prefix_cache or not (e.prefix_cache_ram_mib or e.prefix_cache_dir):
        return None
    if e.kv_cache_type != "f16":
        log.info("the prefix cache keeps no entries in RAM or on disk over a %s KV cache", e.kv_cache_type)
        return None
    return SpillStore(fingerprint, e.prefix_cache_ram_mib << 20, e.prefix_cache_dir, e.prefix_cache_disk_mib << 20)


@dataclass(frozen=True)
class Plan:
    """What `servelm serve` (with or without --ray) and `servelm batch` run, read once from the settings and the
    config file: the deployments loaded at start and those loaded when a request names them (each with
    --content-blocklist), the weighted endpoints, the API keys (SHA-256 digests: the keys themselves go no
    further) and whether llama.cpp logs. Every other part is derived from it (`builder`, `trace_settings`)."""

    settings: ServerSettings
    specs: tuple[DeploymentSpec, ...] = ()
    on_demand: tuple[DeploymentSpec, ...] = ()
    endpoints: tuple[EndpointSpec, ...] = ()
    keys: tuple[KeySpec, ...] = ()
    mcp_servers: tuple[McpServerSpec, ...] = ()  # the config file's MCP servers (requests name them by label)
    verbose_llama: bool = False

    @classmethod
    def read(cls, settings: ServerSettings, *, verbose_llama: bool = False, serving: bool = True) -> Plan:
        """The config file's deployments, else the command line's model and the embedding model (a server with only
        --models-dir: none, its models are all there is). `serving` False (`servelm batch`): no keys, and every
        deployment loaded at start."""
        config = load_config_file(settings.config) if settings.config else None
        keys = load_keys(settings, config.keys if config else []) if serving else []
        if config and config.deployments:
            specs = config.deployments
        else:
            specs = [] if serving and settings.models_dir and settings.model_path is None else default_specs(settings)
        specs = with_blocklist(specs, settings.content_blocklist)
        return cls(settings, specs=tuple(s for s in specs if not serving or s.load == "start"),
                   on_demand=tuple(s for s in specs if serving and s.load == "on-demand"),
                   endpoints=tuple(config.endpoints if config else ()), keys=tuple(keys),
                   mcp_servers=tuple(config.mcp_servers if config and serving else ()), verbose_llama=verbose_llama)

    def builder(self) -> Builder:
        return Builder(self.verbose_llama, image_sources(self.settings), self.settings.content_blocklist,
                       self.settings.self_check_dir())

    def trace_settings(self) -> TraceSettings | None:
        """--otlp-traces-endpoint and its companions as TraceSettings (None: tracing off)."""
        from servelm.tracing import TraceSettings

        s = self.settings
        return TraceSettings(s.otlp_traces_endpoint, s.otlp_protocol, s.otlp_capture_content) \
            if s.otlp_traces_endpoint else None
