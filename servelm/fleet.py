"""Models loaded when a request names them and unloaded when idle: the server's ModelCatalog
(service/registry/catalog.py).

Its models are the GGUF files of `--models-dir` (each a deployment named by its stem) and the config file's
deployments with `load = "on-demand"`. A model is loaded by the server's compose.Builder on a worker thread while its first
requests wait (service/registry/catalog.ModelCatalog.use), added to the app's Deployments, and removed from them before
its engine stops. Its engine's stop writes its prefix cache to its `--prefix-cache-dir` (engine/spill.py), and
the next load indexes those files, so a conversation resumed after a wake reads its history from disk.

Bounds: `--models-max` models and `--models-memory-mib` of their memory (what compose says each part may take);
a load past either unloads the least recently used idle model first, and a model with requests under way is
never unloaded for another. `keep_alive` (Ollama's) or `--idle-unload-s` says how long an idle model stays.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import logging
import re
import time
import tomllib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from servelm.compose import Builder, Built
from servelm.config import DeploymentSpec, EngineSettings, ServerSettings
from servelm.errors import InvalidParameter, ModelNotFound, ServiceUnavailable
from servelm.gguf_header import NotGGUF, open_regular, read_metadata
from servelm.metrics import ModelCounts
from servelm.service.registry.catalog import ModelStatus, Status
from servelm.service.registry.deployments import Deployments

log = logging.getLogger("servelm.fleet")
MiB = 1 << 20
# llama.cpp's encoder-only architectures: their files serve embeddings
ENCODERS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "modern-bert", "neo-bert"})
RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK, in a GGUF's ARCH.pooling_type
RETRY_AFTER_S = 5  # a load refused for want of room: about when a running request may have ended
MAX_NAME_BYTES = 200  # a models directory's model name (a file's stem, a folder): with mmproj- or .gguf, a file name
MAX_SETTINGS_BYTES = 1 << 20  # a NAME.toml
NOT_MODELS_KEPT = 4096  # names found not to be models, remembered with what was on disk under them
_SHARD = re.compile(r"-(\d{5})-of-\d{5}$")


@dataclass(eq=False)
class _Model:
    name: str
    spec: DeploymentSpec | None  # None: its settings file could not be read (`reason` says why)
    status: Status = "unloaded"
    reason: str | None = None
    from_dir: bool = False  # found in --models-dir (not a config's on-demand deployment): gone when its file is
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

    @classmethod
    def of(cls, settings: ServerSettings) -> FleetLimits:
        """--models-max, --models-memory-mib and --idle-unload-s."""
        return cls(settings.models_max, settings.models_memory_mib << 20, settings.idle_unload_s)


def model_name_ok(name: str) -> bool:
    """Whether `name` may name a model of a models directory, before any look at the disk: one path component of
    at most MAX_NAME_BYTES of UTF-8, neither a projector (mmproj*) nor a shard after a model's first."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return False
    shard = _SHARD.search(name)
    return 0 < size <= MAX_NAME_BYTES and name not in (".", "..") and "/" not in name and "\0" not in name \
        and not name.startswith("mmproj") and (shard is None or shard.group(1) == "00001")


def scan_models_dir(directory: Path, engine: EngineSettings) -> tuple[list[DeploymentSpec], dict[str, str]]:
    """Every model of a models directory as an on-demand spec, and the names whose settings could not be read
    with the reason. A regular file X.gguf is the model X, with mmproj-X.gguf its projector and X.toml its settings
    (a [[deployments]] table without name and model); a subdirectory X holding one model GGUF (and an mmproj*.gguf)
    is the model X, with X/X.toml or X.toml its settings. Anything else (a FIFO, a name past MAX_NAME_BYTES) is
    passed over."""
    specs: list[DeploymentSpec] = []
    failed: dict[str, str] = {}
    for path in sorted(directory.iterdir()):
        _take(_found_at(directory, path), engine, specs, failed)
    return specs, failed


def look_for(directory: Path, name: str, engine: EngineSettings,
             seen: tuple[object, ...] | None) -> tuple[tuple[object, ...] | None, list[DeploymentSpec], dict[str, str]]:
    """The one model `name` would be in the directory (X.gguf, else the folder X), without scanning the rest:
    what is on disk under the name (its signature), and the spec or the failure found there. Nothing is read
    when the signature is `seen` (what an earlier look found not to be a model)."""
    specs: list[DeploymentSpec] = []
    failed: dict[str, str] = {}
    marks = _signature(directory, name)
    if marks is not None and marks != seen:
        found = _found_at(directory, directory / f"{name}.gguf") or _found_at(directory, directory / name)
        _take(found if found is not None and found.name == name else None, engine, specs, failed)
    return marks, specs, failed


@dataclass(frozen=True)
class _Found:
    name: str
    model: Path
    projector: Path | None
    settings: Path | None


def _found_at(directory: Path, path: Path) -> _Found | None:
    """The model a directory's entry is, if it is one."""
    if path.is_dir():
        if not model_name_ok(path.name):
            return None
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        models = [p for p in ggufs if not p.name.startswith("mmproj")]
        shards = [p for p in models if "-00001-of-" in p.name]
        if len(models) != 1 and len(shards) != 1:
            if models:
                log.warning("%s: %d model files and no first shard; serving none of them", path, len(models))
            return None
        name = path.name
        projector = next((p for p in ggufs if p.name.startswith("mmproj")), None)
        settings = next((p for p in (path / f"{name}.toml", directory / f"{name}.toml") if p.is_file()), None)
        return _Found(name, (shards or models)[0], projector, settings)
    if path.suffix.lower() != ".gguf" or not model_name_ok(path.stem):
        return None
    if not path.is_file():
        if path.exists():
            log.warning("%s is not a regular file; it is not served", path)
        return None
    projector, settings = directory / f"mmproj-{path.stem}.gguf", directory / f"{path.stem}.toml"
    return _Found(path.stem, path, projector if projector.is_file() else None, settings if settings.is_file() else None)


def _take(found: _Found | None, engine: EngineSettings, specs: list[DeploymentSpec], failed: dict[str, str]) -> None:
    if found is None:
        return
    try:
        specs.append(_spec(found, engine))
    except (OSError, ValueError) as exc:
        failed[found.name] = str(exc)


def _signature(directory: Path, name: str) -> tuple[object, ...] | None:
    """What a look for `name` reads first: X.gguf's and the folder X's type, inode, size and time (a folder's time
    changes as its entries come and go); None when neither is there."""
    marks: list[object] = []
    for path in (directory / f"{name}.gguf", directory / name):
        try:
            st = path.stat()
        except (OSError, ValueError):
            marks.append(None)
            continue
        marks.append((st.st_mode, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(marks) if any(marks) else None


def _spec(found: _Found, engine: EngineSettings) -> DeploymentSpec:
    name, model, settings = found.name, found.model, found.settings
    table: dict[str, Any] = {}
    if settings is not None:
        try:
            table = tomllib.loads(_read_settings(settings))
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
    if found.projector is not None:
        table.setdefault("mmproj", found.projector)
    try:
        return DeploymentSpec(name=name, model=str(model), load="on-demand", engine=EngineSettings(**fields), **table)
    except ValidationError as exc:
        raise ValueError(f"{settings or model}: {exc}") from None


def _read_settings(path: Path) -> str:
    with open_regular(path) as f:
        text = f.read(MAX_SETTINGS_BYTES + 1)
    if len(text) > MAX_SETTINGS_BYTES:
        raise ValueError(f"{path}: over {MAX_SETTINGS_BYTES >> 10} KiB, more than any settings file needs")
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 ({exc})") from None


def _kind(path: Path) -> str:
    """What a GGUF serves: "rerank" for rank pooling (a cross-encoder), "embedding" for an encoder architecture,
    else "chat" (also when the file's metadata cannot be read: the load will say why). Remembered for each
    version of each file (its inode, size and time)."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return "chat"
    return _kind_of(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def _kind_of(path: str, *version: int) -> str:
    try:
        meta = read_metadata(path, lambda key: key == "general.architecture" or key.endswith(".pooling_type"))
    except (OSError, NotGGUF) as exc:
        log.warning("%s: its metadata cannot be read (%s); it is listed as a chat model", path, exc)
        return "chat"
    arch = meta.get("general.architecture")
    if meta.get(f"{arch}.pooling_type") == RANK_POOLING:
        return "rerank"
    return "embedding" if arch in ENCODERS else "chat"


class Fleet:
    """The on-demand models: their state, their loads and unloads, and the task that unloads idle ones."""

    def __init__(self, specs: list[DeploymentSpec], limits: FleetLimits = FleetLimits(), *,
                 models_dir: Path | None = None, engine: EngineSettings | None = None,
                 builder: Callable[[DeploymentSpec], Built] = Builder().one) -> None:
        """`builder` loads one spec's model (a default compose.Builder's; the server's adds its content policy and
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
        self._scans = asyncio.Lock()  # one look at the directory at a time: who waits finds what it found
        self._scans_begun = 0
        self._not_models: dict[str, tuple[object, ...]] = {}  # a name's signature when it was found not a model
        for spec in specs:
            self._add(spec)
        if models_dir is not None:  # before the server starts: no loop to block yet
            self._scanned(self._scan())

    # -- the catalog (service/registry/catalog.ModelCatalog) --

    def statuses(self) -> dict[str, ModelStatus]:
        return {m.name: ModelStatus(m.status, m.reason) for m in self._models.values()}

    async def resolve(self, model: str) -> str | None:
        name = self._aliases.get(model, model)
        directory = self.models_dir
        if name in self._models or directory is None or not model_name_ok(name) or \
                self._registry is not None and self._registry.targets(model):  # the app's own deployments
            return name if name in self._models else None
        # a file added since the last scan, looked for off the loop: first what is on disk under the name (in
        # parallel), then, for something new there, a look at it (one at a time; who waited finds what it found)
        marks = await asyncio.to_thread(_signature, directory, name)
        if marks is not None and marks != self._not_models.get(name):
            async with self._scans:
                if name not in self._models:
                    marks, specs, failed = await asyncio.to_thread(look_for, directory, name, self._engine,
                                                                   self._not_models.get(name))
                    self._know(specs, failed)
                    if marks is not None and not specs and not failed:
                        if len(self._not_models) >= NOT_MODELS_KEPT:
                            self._not_models.clear()
                        self._not_models[name] = marks
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

    async def refresh(self) -> None:
        asked = self._scans_begun
        async with self._scans:
            if self._scans_begun > asked:  # a scan that began after this call has ended: it saw what this one would
                return
            self._scans_begun += 1
            self._scanned(await asyncio.to_thread(self._scan))

    # -- the app's lifetime --

    def attach(self, registry: Deployments) -> None:
        """The app's deployments, where loaded models are added (with its engine wrappers) and removed."""
        self._registry = registry

    async def start(self) -> None:
        # what the server built before serving (its imports, its app, its models loaded at start) lives as long
        # as it does: out of every later collection's way, so that an unload's (free) and the interpreter's own
        # full collections read only what came since, in a few milliseconds instead of a tenth of a second with
        # the GIL held (every thread, the event loop's first, waiting)
        await asyncio.to_thread(gc.collect)
        gc.freeze()
        self._changed = asyncio.Condition()
        self._reaper = asyncio.create_task(self._reap())

    async def stop(self) -> None:
        """Every loaded model unloaded (its prefix cache written to disk)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for model in self._models.values():
            if model.built is not None:
                await asyncio.to_thread(free_taken, _Taken(model))
                model.status = "unloaded"

    def counts(self) -> list[ModelCounts]:
        return [ModelCounts(m.name, m.status, m.loaded_bytes if m.status == "loaded" else 0, m.loads, m.load_failures,
                            m.unloads, m.load_seconds) for m in self._models.values()]

    # -- inside --

    def _scan(self) -> tuple[list[DeploymentSpec], dict[str, str]] | None:
        if self.models_dir is None:
            return None
        if not self.models_dir.is_dir():
            log.warning("--models-dir %s is not a directory", self.models_dir)
            return None
        return scan_models_dir(self.models_dir, self._engine)

    def _scanned(self, found: tuple[list[DeploymentSpec], dict[str, str]] | None) -> None:
        if found is not None:
            self._know(*found)
            self._forget_gone({spec.name for spec in found[0]} | set(found[1]))
            log.info("models directory %s: %d models", self.models_dir, len(found[0]) + len(found[1]))

    def _know(self, specs: list[DeploymentSpec], failed: dict[str, str]) -> None:
        for spec in specs:
            known = self._models.get(spec.name)
            if known is None or known.spec is None:
                self._add(spec, from_dir=True)
            elif known.status in ("unloaded", "failed"):
                known.spec, known.status, known.reason = spec, "unloaded", None  # its settings may have changed
        for name, reason in failed.items():
            known = self._models.get(name)
            if known is None or known.status in ("unloaded", "failed"):
                self._models[name] = _Model(name, None, "failed", reason, from_dir=True)

    def _forget_gone(self, found: set[str]) -> None:
        """The directory's models a full scan no longer found, unless loaded or in use (those go at their unload's
        next scan): no longer listed, nor loadable."""
        gone = [m for m in self._models.values() if m.from_dir and m.name not in found and m.built is None
                and m.status in ("unloaded", "failed") and not m.leases and not m.draining]
        for model in gone:
            del self._models[model.name]
            self._aliases = {a: n for a, n in self._aliases.items() if n != model.name}
        if gone:
            log.info("models directory %s: %s gone from it", self.models_dir, ", ".join(m.name for m in gone))

    def _add(self, spec: DeploymentSpec, from_dir: bool = False) -> None:
        self._models[spec.name] = _Model(spec.name, spec, from_dir=from_dir)
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
        async with changed:
            if self._registry is not None and model.built is not None:
                for d in model.built.deployments.all():
                    self._registry.remove(d.name)
        if model.built is not None:
            # the engine writes its prefix cache out as it stops; the thread holds the only reference, so that its
            # collection finds the model's objects garbage
            await asyncio.to_thread(free_taken, _Taken(model))
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


class _Taken:
    """A model's Built taken from it for free_taken: the caller keeps no reference of its own."""

    def __init__(self, model: _Model) -> None:
        self.built: Built | None = model.built
        model.built = None


def free_taken(taken: _Taken) -> None:
    """free() of a model's Built, holding its only reference (on a worker thread: nothing of it on the loop)."""
    built, taken.built = taken.built, None
    if built is None:
        return
    built.stop()
    built.close()
    del built
    _give_back_memory()


def free(built: Built) -> None:
    """A loaded model stopped, closed and its memory handed back (a Ray replica's unload uses it too)."""
    built.stop()
    built.close()
    del built
    _give_back_memory()


def _give_back_memory() -> None:
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

