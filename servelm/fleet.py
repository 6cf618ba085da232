"""Models loaded when a request names them and unloaded when idle: the server's ModelCatalog
(service/catalog.py).

Its models are the GGUF files of `--models-dir` (each a deployment named by its stem) and the config file's
deployments with `load = "on-demand"`. A model is loaded by compose.build on a worker thread while its first
requests wait (service/catalog.ModelCatalog.use), added to the app's Deployments, and removed from them before
its engine stops. Its engine's stop writes its prefix cache to its `--prefix-cache-dir` (engine/spill.py), and
the next load indexes those files, so a conversation resumed after a wake reads its history from disk.

Bounds: `--models-max` models and `--models-memory-mib` of their memory (what compose says each part may take);
a load past either unloads the least recently used idle model first, and a model with requests under way is
never unloaded for another. `keep_alive` (Ollama's) or `--idle-unload-s` says how long an idle model stays.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
import tomllib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from servelm.compose import Built, build
from servelm.config import DeploymentSpec, EngineSettings
from servelm.errors import InvalidParameter, ModelNotFound, ServiceUnavailable
from servelm.metrics import ModelCounts
from servelm.service.catalog import ModelStatus, Status
from servelm.service.deployments import Deployments

log = logging.getLogger("servelm.fleet")
MiB = 1 << 20
# llama.cpp's encoder-only architectures: their files serve embeddings
ENCODERS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "modern-bert", "neo-bert"})
RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK, in a GGUF's ARCH.pooling_type
RETRY_AFTER_S = 5  # a load refused for want of room: about when a running request may have ended


@dataclass(eq=False)
class _Model:
    name: str
    spec: DeploymentSpec | None  # None: its settings file could not be read (`reason` says why)
    status: Status = "unloaded"
    reason: str | None = None
    built: Built | None = None
    leases: int = 0  # requests holding it loaded
    draining: bool = False  # an unload waits for its requests to end; new ones wait for the unload
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float | None = None  # the last request's; None: --idle-unload-s
    loaded_bytes: int = 0
    loads: int = 0  # counters for /metrics
    load_failures: int = 0
    unloads: int = 0
    load_seconds: float = 0.0

    @property
    def estimate(self) -> int:
        """Memory before loading: the files and the KV budget (after: what compose said each part may take)."""
        if self.loaded_bytes:
            return self.loaded_bytes
        if self.spec is None:
            return 0
        files = [Path(self.spec.model), *([self.spec.mmproj] if self.spec.mmproj else [])]
        size = sum(p.stat().st_size for p in files if p.is_file())
        return size + (self.spec.engine.kv_budget_mib * MiB if self.spec.kind == "chat" else 128 * MiB)


@dataclass(frozen=True)
class FleetLimits:
    models_max: int = 4
    memory_bytes: int = 0  # 0: no bound
    idle_unload_s: float = 300.0  # negative: never


def scan_models_dir(directory: Path, engine: EngineSettings) -> tuple[list[DeploymentSpec], dict[str, str]]:
    """Every model of a models directory as an on-demand spec, and the names whose settings could not be read
    with the reason. A file X.gguf is the model X, with mmproj-X.gguf its projector and X.toml its settings (a
    [[deployments]] table without name and model); a subdirectory X holding one model GGUF (and an mmproj*.gguf)
    is the model X, with X/X.toml or X.toml its settings."""
    specs: list[DeploymentSpec] = []
    failed: dict[str, str] = {}
    for path in sorted(directory.iterdir()):
        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            models = [p for p in ggufs if not p.name.startswith("mmproj")]
            shards = [p for p in models if "-00001-of-" in p.name]
            if len(models) != 1 and len(shards) != 1:
                if models:
                    log.warning("%s: %d model files and no first shard; serving none of them", path, len(models))
                continue
            name, model = path.name, (shards or models)[0]
            projector = next((p for p in ggufs if p.name.startswith("mmproj")), None)
            settings = next((p for p in (path / f"{name}.toml", directory / f"{name}.toml") if p.is_file()), None)
        elif path.suffix.lower() == ".gguf" and not path.name.startswith("mmproj") \
                and not path.stem.split("-00")[-1].startswith(("002", "003", "004", "005", "006", "007", "008", "009")):
            name, model = path.stem, path
            found = directory / f"mmproj-{name}.gguf"
            projector = found if found.is_file() else None
            settings = directory / f"{name}.toml"
            settings = settings if settings.is_file() else None
        else:
            continue
        try:
            specs.append(_spec(name, model, projector, settings, engine))
        except (OSError, ValueError) as exc:
            failed[name] = str(exc)
    return specs, failed


def _spec(name: str, model: Path, projector: Path | None, settings: Path | None, engine: EngineSettings) -> DeploymentSpec:
    table: dict[str, Any] = {}
    if settings is not None:
        try:
            table = tomllib.loads(settings.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{settings}: not valid TOML: {exc}") from None
        for key in ("name", "model", "load"):
            if key in table:
                raise ValueError(f"{settings}: `{key}` is the file's own (its name, its path, on demand)")
    own_engine = table.pop("engine", {})
    if not isinstance(own_engine, dict):
        raise ValueError(f"{settings}: `engine` must be a table of engine settings")
    fields = {**engine.model_dump(exclude_unset=True), **own_engine}
    if engine.prefix_cache_dir and "prefix_cache_dir" not in own_engine:  # each model's entries in its own folder
        fields["prefix_cache_dir"] = str(Path(engine.prefix_cache_dir) / name)
    table.setdefault("kind", _kind(model))
    if projector is not None:
        table.setdefault("mmproj", projector)
    try:
        return DeploymentSpec(name=name, model=str(model), load="on-demand", engine=EngineSettings(**fields), **table)
    except ValidationError as exc:
        raise ValueError(f"{settings or model}: {exc}") from None


def _kind(path: Path) -> str:
    """What a GGUF serves: "rerank" for rank pooling (a cross-encoder), "embedding" for an encoder architecture,
    else "chat" (also when the file cannot be read: the load will say why)."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(path).fields
        fld = fields["general.architecture"]
        arch = bytes(fld.parts[fld.data[0]]).decode()
        pooling = fields.get(f"{arch}.pooling_type")
        if pooling is not None and int(pooling.parts[pooling.data[0]][0]) == RANK_POOLING:
            return "rerank"
        return "embedding" if arch in ENCODERS else "chat"
    except Exception:
        return "chat"


class Fleet:
    """The on-demand models: their state, their loads and unloads, and the task that unloads idle ones."""

    def __init__(self, specs: list[DeploymentSpec], limits: FleetLimits = FleetLimits(), *,
                 models_dir: Path | None = None, engine: EngineSettings | None = None,
                 builder: Callable[[DeploymentSpec], Built] = lambda spec: build([spec], [])) -> None:
        """`builder` loads one spec's model (compose.build by default; the server's adds its content policy and
        image sources; tests give a fake runner's)."""
        self.limits = limits
        self.models_dir = models_dir
        self._engine = engine or EngineSettings()
        self._build = builder
        self._models: dict[str, _Model] = {}
        self._aliases: dict[str, str] = {}
        self._registry: Deployments | None = None
        self._changed: asyncio.Condition | None = None
        self._reaper: asyncio.Task[None] | None = None
        for spec in specs:
            self._add(spec)
        if models_dir is not None:
            self.refresh()

    # -- the catalog (service/catalog.ModelCatalog) --

    def statuses(self) -> dict[str, ModelStatus]:
        return {m.name: ModelStatus(m.status, m.reason) for m in self._models.values()}

    def resolve(self, model: str) -> str | None:
        name = self._aliases.get(model, model)
        if name not in self._models and self.models_dir is not None and _may_be_file(self.models_dir, name):
            self.refresh()  # a file added since the last scan
        return name if name in self._models else None

    @asynccontextmanager
    async def use(self, name: str, keep_alive: float | None) -> AsyncIterator[None]:
        model = self._model(name)
        await self._acquire(model)
        if keep_alive is not None:
            model.keep_alive = keep_alive
        try:
            yield
        finally:
            await self._release(model)

    async def load(self, name: str) -> None:
        model = self._model(name)
        await self._acquire(model)
        await self._release(model)

    async def unload(self, name: str) -> None:
        model = self._model(name)
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: model.status not in ("loading",) and not model.draining)
            if model.status != "loaded":
                return
            model.draining = True
            await changed.wait_for(lambda: model.leases == 0)
        await self._unload(model, "route")

    def refresh(self) -> None:
        if self.models_dir is None:
            return
        if not self.models_dir.is_dir():
            log.warning("--models-dir %s is not a directory", self.models_dir)
            return
        specs, failed = scan_models_dir(self.models_dir, self._engine)
        for spec in specs:
            known = self._models.get(spec.name)
            if known is None or known.spec is None:
                self._add(spec)
            elif known.status in ("unloaded", "failed"):
                known.spec, known.status, known.reason = spec, "unloaded", None  # its settings may have changed
        for name, reason in failed.items():
            known = self._models.get(name)
            if known is None or known.status in ("unloaded", "failed"):
                self._models[name] = _Model(name, None, "failed", reason)
        log.info("models directory %s: %d models", self.models_dir, len(specs) + len(failed))

    # -- the app's lifetime --

    def attach(self, registry: Deployments) -> None:
        """The app's deployments, where loaded models are added (with its engine wrappers) and removed."""
        self._registry = registry

    async def start(self) -> None:
        self._changed = asyncio.Condition()
        self._reaper = asyncio.create_task(self._reap())

    async def stop(self) -> None:
        """Every loaded model unloaded (its prefix cache written to disk)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for model in self._models.values():
            if model.built is not None:
                await asyncio.to_thread(free, model.built)
                model.built, model.status = None, "unloaded"

    def counts(self) -> list[ModelCounts]:
        return [ModelCounts(m.name, m.status, m.loaded_bytes if m.status == "loaded" else 0, m.loads, m.load_failures,
                            m.unloads, m.load_seconds) for m in self._models.values()]

    # -- inside --

    def _add(self, spec: DeploymentSpec) -> None:
        self._models[spec.name] = _Model(spec.name, spec)
        self._aliases.update({a: spec.name for a in spec.aliases})

    def _model(self, name: str) -> _Model:
        model = self._models.get(self._aliases.get(name, name))
        if model is None:
            raise ModelNotFound(name)
        return model

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # used before the app started (tests driving it directly)
            self._changed = asyncio.Condition()
        return self._changed

    async def _acquire(self, model: _Model) -> None:
        changed = self._condition()
        async with changed:
            while True:
                if model.status == "loaded" and not model.draining:
                    model.leases += 1
                    return
                if model.status != "loading" and not model.draining:
                    break
                await changed.wait()
            if model.spec is None:
                raise InvalidParameter(f"The model `{model.name}` cannot be loaded: {model.reason}", "model",
                                       code="model_load_failed")
            victims = self._make_room(model)
            model.status, model.reason = "loading", None
            for victim in victims:
                victim.draining = True
        for victim in victims:
            await self._unload(victim, "evicted")
        started = time.monotonic()
        try:
            built = await asyncio.to_thread(self._start, model.spec)
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            async with changed:
                model.status, model.reason = "failed", reason
                model.load_failures += 1
                changed.notify_all()
            log.warning("loading %r failed: %s", model.name, reason)
            if isinstance(exc, MemoryError):
                raise _no_room(f"The model `{model.name}` could not be loaded: out of memory.") from None
            raise InvalidParameter(f"The model `{model.name}` could not be loaded: {reason}", "model",
                                   code="model_load_failed") from None
        async with changed:
            model.built = built
            model.loaded_bytes = sum(sum(d.memory.values()) for d in built.deployments.all()) or model.estimate
            if self._registry is not None:
                for d in built.deployments.all():
                    self._registry.add(d, model.spec.aliases)
            model.status, model.last_used = "loaded", time.monotonic()
            model.loads += 1
            model.load_seconds += time.monotonic() - started
            model.leases += 1
            changed.notify_all()
        log.info("loaded %r in %.1f s (%d MiB)", model.name, time.monotonic() - started, model.loaded_bytes >> 20)

    def _start(self, spec: DeploymentSpec) -> Built:
        built = self._build(spec)
        try:
            built.start()
        except BaseException:
            built.close()
            raise
        return built

    def _make_room(self, model: _Model) -> list[_Model]:
        """The idle models to unload, least recently used first, so that this one fits; a 503 when it cannot."""
        held = [m for m in self._models.values() if m is not model and m.status in ("loaded", "loading")]
        idle = sorted((m for m in held if m.status == "loaded" and m.leases == 0 and not m.draining),
                      key=lambda m: m.last_used)
        need, budget = model.estimate, self.limits.memory_bytes
        victims: list[_Model] = []
        while len(held) - len(victims) + 1 > self.limits.models_max or \
                budget and sum(m.estimate for m in held if m not in victims) + need > budget:
            if not idle:
                if budget and need > budget:
                    raise _no_room(f"The model `{model.name}` needs about {need >> 20} MiB, more than "
                                   f"--models-memory-mib ({budget >> 20}).")
                raise _no_room(f"The model `{model.name}` cannot be loaded now: every loaded model has requests "
                               f"under way (--models-max {self.limits.models_max}, --models-memory-mib "
                               f"{budget >> 20}). Retry later.")
            victims.append(idle.pop(0))
        return victims

    async def _release(self, model: _Model) -> None:
        changed = self._condition()
        async with changed:
            model.leases -= 1
            model.last_used = time.monotonic()
            changed.notify_all()
        if model.leases == 0 and model.keep_alive == 0:
            await self.unload(model.name)

    async def _unload(self, model: _Model, why: str) -> None:
        changed = self._condition()
        built = model.built
        async with changed:
            if self._registry is not None and built is not None:
                for d in built.deployments.all():
                    self._registry.remove(d.name)
        if built is not None:
            await asyncio.to_thread(free, built)  # the engine writes its prefix cache out as it stops
        async with changed:
            model.built, model.status, model.draining, model.loaded_bytes = None, "unloaded", False, 0
            model.unloads += 1
            changed.notify_all()
        log.info("unloaded %r (%s)", model.name, why)

    async def _reap(self) -> None:
        """Unloads each model idle past its keep_alive, checking every second."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for model in list(self._models.values()):
                keep = model.keep_alive if model.keep_alive is not None else self.limits.idle_unload_s
                if model.status == "loaded" and model.leases == 0 and not model.draining and 0 <= keep <= now - model.last_used:
                    try:
                        await self.unload(model.name)
                    except Exception:
                        log.exception("unloading idle %r failed", model.name)


def free(built: Built) -> None:
    """A loaded model stopped, closed and its memory handed back (a Ray replica's unload uses it too)."""
    built.stop()
    built.close()
    del built
    gc.collect()  # the model's Python objects (vocabulary tables, grammars) go now, not at some later collection
    _trim()


def _trim() -> None:
    """Hands the heap's free pages back to the system (glibc keeps them otherwise), so an unloaded model's RSS
    goes; nothing elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _no_room(message: str) -> ServiceUnavailable:
    error = ServiceUnavailable(message, code="model_not_loaded")
    error.headers = {"Retry-After": str(RETRY_AFTER_S)}
    return error


def _may_be_file(directory: Path, name: str) -> bool:
    """Whether `name` could be a model added to the directory since (a cheap check before a rescan)."""
    return "/" not in name and name not in (".", "..") and (
        (directory / f"{name}.gguf").is_file() or (directory / name).is_dir())
