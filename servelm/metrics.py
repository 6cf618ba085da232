"""Every Prometheus collector, declared once, in a registry of its own per app (tests build many apps in one
process, so nothing goes to prometheus_client's global default registry).

A leaf: it imports nothing of servelm. Engine counts reach it at scrape time through a callable that
returns one `EngineGauges` per deployment; generation timings through `GenerationMeter`, which the service
layer's MeteredEngine calls without knowing about Prometheus.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the text format every Prometheus reads (our names need no UTF-8 escaping)

# seconds; a 135M model on 2 cores answers in tens of milliseconds, a big one on a busy server in tens of seconds
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
# how late the event loop ran a timer: under 10 ms when nothing blocks it, seconds when something does
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LOOP_TICK = 0.05  # seconds between the loop monitor's timers
# the least time between two renders of the exposition (about 1.5 ms of Python on the event loop each): scrapes that
# come closer together share one, begun after the last of them arrived
RENDER_EVERY_S = 0.25
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
# The event loop thread's CPU seconds in the parts of a stream it spends per chunk (process-wide: the streams add to
# them, every app's /metrics shows them): serialize (a chunk's JSON and its frame), write (the frame handed to the
# server's transport and the socket). Sampled: of a stream's chunks made as JSON already (its text, the hot path) one
# in STREAM_CPU_SAMPLE is timed and counts that many times, the others each (a thread's CPU clock is a system call of
# 1-2 us: reading it around every chunk cost about a tenth of the chunk's own time).
STREAM_CPU_SECONDS = {"serialize": 0.0, "write": 0.0}
STREAM_CPU_SAMPLE = 8
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class EngineGauges:
    """One deployment's engine counts at scrape time."""

    model: str
    waiting: int
    running: int
    kv_cells_used: int
    kv_cells_cached: int
    kv_cells_total: int
    kv_cell_bytes: int = 0
    cache_hits: int = 0
    cached_tokens: int = 0
    step_seconds: float = 0.0  # counters: the engine thread's time in steps, and of it in the forward pass
    forward_seconds: float = 0.0
    steps: int = 0  # counters: steps with work, and the llama_decode calls they made
    forward_calls: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # counters: the engine thread's time by phase
    draft_tokens: int = 0  # counters: speculative guesses read, and those that held
    draft_accepted: int = 0
    spill_ram_bytes: int = 0  # the prefix cache's spilled entries in host RAM and on disk
    spill_disk_bytes: int = 0
    spill_restored: int = 0  # counter: spilled entries read back into a slot
    spill_restore_failures: int = 0  # counter: spilled entries the model refused (dropped)
    preemptions: int = 0  # counter: running requests that gave their slot up to a higher priority
    resumed_tokens: int = 0  # counter: of their tokens, those found cached again when they resumed
    # each tenant's (an API key's label, or a client's address) slots and waiting requests now, and tokens since start
    tenants: tuple[tuple[str, int, int, int], ...] = ()


class _EngineCollector(Collector):
    """Fills the engine gauges when Prometheus scrapes, so nothing has to update them on every step."""

    def __init__(self, source: Callable[[], Iterable[EngineGauges]]) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "waiting": GaugeMetricFamily("servelm_requests_waiting", "sequences waiting to be scheduled (queue depth)", labels=["model"]),
            "running": GaugeMetricFamily("servelm_sequences_running", "sequences being decoded", labels=["model"]),
            "kv_cells_used": GaugeMetricFamily("servelm_kv_cells_used", "KV cache cells held by running requests", labels=["model"]),
            "kv_cells_cached": GaugeMetricFamily("servelm_kv_cells_cached", "KV cache cells held by the prefix cache", labels=["model"]),
            "kv_cells_total": GaugeMetricFamily("servelm_kv_cells_capacity", "KV cache cells in all", labels=["model"]),
            "kv_bytes": GaugeMetricFamily("servelm_kv_cache_bytes", "the KV cache's size in memory", labels=["model"]),
            "cache_hits": CounterMetricFamily("servelm_prefix_cache_hits", "requests that started from cached cells",
                                              labels=["model"]),
            "cached_tokens": CounterMetricFamily("servelm_prefix_cache_tokens", "prompt tokens read from the prefix "
                                                 "cache instead of computed", labels=["model"]),
            "step_seconds": CounterMetricFamily("servelm_engine_step_seconds", "engine-thread time in steps with work",
                                                labels=["model"]),
            "forward_seconds": CounterMetricFamily("servelm_engine_forward_seconds", "of which in the model's forward "
                                                   "pass (llama_decode); the rest is the loop's own overhead",
                                                   labels=["model"]),
            "steps": CounterMetricFamily("servelm_engine_steps", "engine steps with work", labels=["model"]),
            "forward_calls": CounterMetricFamily("servelm_engine_forward_calls", "llama_decode calls those steps made "
                                                 "(more than one a step when its rows cannot share a pass exactly)",
                                                 labels=["model"]),
            # vLLM's spec_decode_num_draft_tokens and spec_decode_num_accepted_tokens
            "draft_tokens": CounterMetricFamily("servelm_spec_decode_draft_tokens", "speculative guesses (drafted "
                                                "tokens) read by decoding sequences", labels=["model"]),
            "draft_accepted": CounterMetricFamily("servelm_spec_decode_accepted_tokens", "of which held: tokens made "
                                                  "without a step of their own", labels=["model"]),
            "spill_ram_bytes": GaugeMetricFamily("servelm_prefix_cache_ram_bytes", "prefix-cache entries spilled from "
                                                 "the KV cache to host RAM", labels=["model"]),
            "spill_disk_bytes": GaugeMetricFamily("servelm_prefix_cache_disk_bytes", "prefix-cache entries on disk "
                                                  "(--prefix-cache-dir)", labels=["model"]),
            "spill_restored": CounterMetricFamily("servelm_prefix_cache_restored", "spilled entries read back into "
                                                  "the KV cache for a request", labels=["model"]),
            "spill_restore_failures": CounterMetricFamily(
                "servelm_prefix_cache_restore_failures", "spilled entries whose state the model refused (dropped with "
                "their files; their requests read their prompts)", labels=["model"]),
            "preemptions": CounterMetricFamily("servelm_preemptions", "running requests that gave their slot up to "
                                               "a request of higher priority (they resume with the same answer)",
                                               labels=["model"]),
            "resumed_tokens": CounterMetricFamily("servelm_preempted_tokens_reused", "tokens preempted requests found "
                                                  "cached again (a slot or the spill) when they resumed; the rest "
                                                  "were computed again", labels=["model"]),
        }
        phases = CounterMetricFamily("servelm_engine_phase_seconds", "the engine thread's wall time by phase of its "
                                     "steps: decode (llama_decode), runner, sample, grammar, detokenize, loop, idle "
                                     "(waiting with requests unfinished)", labels=["model", "phase"])
        slots = GaugeMetricFamily("servelm_tenant_slots", "sequence slots a tenant's requests hold (a tenant: an API "
                                  "key's name, or a client's address on a server without keys)", labels=["model", "tenant"])
        waits = GaugeMetricFamily("servelm_tenant_waiting", "a tenant's requests waiting for a slot",
                                  labels=["model", "tenant"])
        tokens = CounterMetricFamily("servelm_tenant_tokens", "tokens the engine computed for a tenant (prompt tokens "
                                     "read, tokens drawn): its fair share's measure", labels=["model", "tenant"])
        for g in self._source():
            for key, family in families.items():
                family.add_metric([g.model], g.kv_cells_total * g.kv_cell_bytes if key == "kv_bytes" else getattr(g, key))
            for phase, seconds in g.phase_seconds.items():
                phases.add_metric([g.model, phase], seconds)
            for tenant, held, waiting, made in g.tenants:
                slots.add_metric([g.model, tenant], held)
                waits.add_metric([g.model, tenant], waiting)
                tokens.add_metric([g.model, tenant], made)
        yield from families.values()
        yield phases
        yield from (slots, waits, tokens)

    def describe(self) -> list[Metric]:
        return []  # collected only on demand: registering must not call the source


def _thread_cpu(tid: int) -> float:
    """A thread of this process: its user + system CPU seconds, 0 once it is gone."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


def _named_threads() -> dict[str, list[int]]:
    """This process's threads named servelm-* (the engines'), by name."""
    found: dict[str, list[int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        if name.startswith("servelm-"):
            found.setdefault(name, []).append(int(tid))
    return found


class _ThreadCollector(Collector):
    """The CPU time of the event loop thread and of the engine threads, and the loop's share in streams' chunks."""

    def __init__(self, loop_thread: Callable[[], int | None]) -> None:
        self._loop_thread = loop_thread

    def collect(self) -> Iterator[CounterMetricFamily]:
        threads = CounterMetricFamily("servelm_thread_cpu_seconds", "CPU seconds of the event loop thread "
                                      "(event_loop: HTTP, the services, streams) and of the engine threads (their "
                                      "steps, llama_decode's share included)", labels=["thread"])
        loop = self._loop_thread()
        if loop is not None:
            threads.add_metric(["event_loop"], _thread_cpu(loop))
        for name, tids in _named_threads().items():
            threads.add_metric([name], sum(_thread_cpu(t) for t in tids))
        yield threads
        parts = CounterMetricFamily("servelm_stream_cpu_seconds", "the event loop thread's CPU seconds in streamed "
                                    "chunks: serialize (the chunk's JSON and frame), write (to the socket); "
                                    f"a stream's text chunks sampled, one in {STREAM_CPU_SAMPLE} timed",
                                    labels=["part"])
        for part, seconds in STREAM_CPU_SECONDS.items():
            parts.add_metric([part], seconds)
        yield parts

    def describe(self) -> list[Metric]:
        return []


# Seconds spent in the cyclic garbage collector by generation, process-wide (one callback, whatever the apps): a
# collection holds the GIL, so every thread (the engine's next step, every stream's chunk) waited that long.
GC_PAUSE_SECONDS = [0.0, 0.0, 0.0]
_gc_started = [0.0]  # when the collection running began (collections never overlap: one at a time, GIL held)


def _time_collections(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        GC_PAUSE_SECONDS[info["generation"]] += time.perf_counter() - _gc_started[0]


gc.callbacks.append(_time_collections)


class _GcCollector(Collector):
    """The garbage collector's pauses, and the objects frozen out of its way (servelm serve freezes what it built
    before serving)."""

    def collect(self) -> Iterator[Metric]:
        pauses = CounterMetricFamily("servelm_gc_pause_seconds", "seconds in the cyclic garbage collector by "
                                     "generation (2: a full collection); it holds the GIL, so every thread waited",
                                     labels=["generation"])
        for generation, seconds in enumerate(GC_PAUSE_SECONDS):
            pauses.add_metric([str(generation)], seconds)
        yield pauses
        yield GaugeMetricFamily("servelm_gc_frozen_objects", "objects frozen out of every collection that are still "
                                "alive: what the server built before serving (modules, models, vocabulary tables), "
                                "less what has gone since", gc.get_freeze_count())

    def describe(self) -> list[Metric]:
        return []


class _ReplicaGcCollector(Collector):
    """Under Ray: the garbage collector's pauses and frozen objects of each deployment's replicas (their own
    processes), added up over the replicas."""

    def __init__(self, source: Callable[[], Iterable[tuple[str, int, Sequence[float]]]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        pauses = CounterMetricFamily("servelm_replica_gc_pause_seconds", "under --ray: seconds in the garbage "
                                     "collector of the deployment's replicas, by generation (each holds its "
                                     "replica's GIL, so its engine waited)", labels=["model", "generation"])
        frozen = GaugeMetricFamily("servelm_replica_gc_frozen_objects", "under --ray: objects the deployment's "
                                   "replicas froze out of every collection (what they built) that are still alive",
                                   labels=["model"])
        for model, count, seconds in self._source():
            frozen.add_metric([model], count)
            for generation, spent in enumerate(seconds):
                pauses.add_metric([model, str(generation)], spent)
        yield pauses
        yield frozen

    def describe(self) -> list[Metric]:
        return []


class _BatchCollector(Collector):
    """The Batch API's batches by status and lines answered, read from its store when Prometheus scrapes."""

    def __init__(self, source: Callable[[], tuple[dict[str, int], int, int]]) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        by_status, ok, failed = self._source()
        batches = GaugeMetricFamily("servelm_batches", "batches of the Batch API by status", labels=["status"])
        for status in ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                       "cancelled"):
            batches.add_metric([status], by_status.get(status, 0))
        lines = CounterMetricFamily("servelm_batch_lines", "batch lines answered, by outcome (completed: a 2xx "
                                    "answer; failed: any other, or none before the batch expired)", labels=["outcome"])
        lines.add_metric(["completed"], ok)
        lines.add_metric(["failed"], failed)
        yield batches
        yield lines

    def describe(self) -> list[Metric]:
        return []


@dataclass(frozen=True)
class ModelCounts:
    """One model loaded on demand (servelm/fleet.py) at scrape time."""

    model: str
    status: str  # loaded, loading, unloaded, failed
    loaded_bytes: int  # what its parts may take while loaded (0 when not)
    loads: int  # counters from here on
    load_failures: int
    unloads: int
    load_seconds: float


class _ModelCollector(Collector):
    """The on-demand models' loads, unloads and memory, read from the catalog when Prometheus scrapes."""

    def __init__(self, source: Callable[[], Iterable[ModelCounts]]) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        loaded = GaugeMetricFamily("servelm_model_loaded", "1 while a model loaded on demand is loaded", labels=["model"])
        size = GaugeMetricFamily("servelm_model_loaded_bytes", "memory a loaded model's parts may take (weights, KV "
                                 "cache, buffers)", labels=["model"])
        loads = CounterMetricFamily("servelm_model_loads", "loads of a model, by outcome", labels=["model", "outcome"])
        unloads = CounterMetricFamily("servelm_model_unloads", "unloads of a model (idle, evicted or by route)",
                                      labels=["model"])
        seconds = CounterMetricFamily("servelm_model_load_seconds", "time its successful loads took", labels=["model"])
        for m in self._source():
            loaded.add_metric([m.model], 1 if m.status == "loaded" else 0)
            size.add_metric([m.model], m.loaded_bytes)
            loads.add_metric([m.model, "loaded"], m.loads)
            loads.add_metric([m.model, "failed"], m.load_failures)
            unloads.add_metric([m.model], m.unloads)
            seconds.add_metric([m.model], m.load_seconds)
        yield from (loaded, size, loads, unloads, seconds)

    def describe(self) -> list[Metric]:
        return []


class _AdapterCollector(Collector):
    """LoRA adapters: loaded or not, and the requests that ran with each, read when Prometheus scrapes."""

    def __init__(self, source: Callable[[], Iterable[tuple[str, str, bool, int]]]) -> None:
        self._source = source  # (model, adapter, loaded, requests)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        loaded = GaugeMetricFamily("servelm_lora_loaded", "1 while a LoRA adapter is loaded", labels=["model", "adapter"])
        requests = CounterMetricFamily("servelm_lora_requests", "requests that ran with a LoRA adapter",
                                       labels=["model", "adapter"])
        for model, adapter, on, count in self._source():
            loaded.add_metric([model, adapter], 1 if on else 0)
            requests.add_metric([model, adapter], count)
        yield loaded
        yield requests

    def describe(self) -> list[Metric]:
        return []


class Metrics:
    """The app's collectors. `route` labels are route templates (never raw paths), `model` deployment names."""

    def __init__(self, engine_gauges: Callable[[], Iterable[EngineGauges]] = lambda: ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("servelm_http_requests", "HTTP requests answered, by route template, method and status",
                                ["route", "method", "status"], registry=r)
        self.request_seconds = Histogram("servelm_http_request_duration_seconds",
                                         "HTTP request duration until the last body byte, by route template",
                                         ["route", "method"], buckets=_REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter("servelm_prompt_tokens", "prompt tokens of generation requests", ["model"], registry=r)
        self.generation_tokens = Counter("servelm_generation_tokens", "tokens generated (all choices)", ["model"], registry=r)
        self.generations = Counter("servelm_generation_requests", "generation requests ended, by how they ended",
                                   ["model", "outcome"], registry=r)
        self.ttft = Histogram("servelm_time_to_first_token_seconds", "from a request reaching the engine to its first output",
                              ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("servelm_inter_token_latency_seconds",
                             "between a choice's successive outputs, per token they carry", ["model"],
                             buckets=_ITL_BUCKETS, registry=r)
        self.queue = Histogram("servelm_request_queue_seconds", "from a request reaching the engine to its first "
                               "step, by priority (-10..10; beyond, <-10 or >10)", ["model", "priority"],
                               buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("servelm_e2e_request_latency_seconds", "from a request reaching the engine to its last output",
                             ["model"], buckets=_E2E_BUCKETS, registry=r)
        self.filtered = Counter("servelm_content_filtered", "requests a content filter blocked, by deployment, "
                                "direction (input, output) and category", ["model", "direction", "category"], registry=r)
        self.scored = Counter("servelm_rerank_pairs", "query-document pairs scored (rerank, score), by deployment and "
                              "how (cross_encoder: a reranker; cosine: an embedding model)", ["model", "kind"], registry=r)
        self.loop_lag = Histogram("servelm_event_loop_lag_seconds", "how late the event loop ran a timer set every "
                                  f"{LOOP_TICK * 1000:.0f} ms: the time every request on it waited on whatever held it",
                                  buckets=_LAG_BUCKETS, registry=r)
        self.loop_lag_max = Gauge("servelm_event_loop_lag_max_seconds", "the longest event-loop lag since the server "
                                  "started", registry=r)
        r.register(_EngineCollector(engine_gauges))
        self._loop_thread: int | None = None  # the event loop's thread (watch_loop runs on it)
        r.register(_ThreadCollector(lambda: self._loop_thread))
        r.register(_GcCollector())
        self._next_render: asyncio.Future[bytes] | None = None  # the render the scrapes that arrived since wait for
        self._rendered_at = -RENDER_EVERY_S  # the event loop's time the last render began

    async def exposition(self) -> bytes:
        """The exposition for a scrape, rendered after it arrived: one render a RENDER_EVERY_S at most, shared by
        every scrape that waits for it, so that a client scraping back to back costs the event loop one render a
        period, not one a request. A scrape that goes away does not cancel the render the others wait for."""
        if self._next_render is None:
            loop = asyncio.get_running_loop()
            self._next_render = loop.create_future()
            self._next_render.add_done_callback(_retrieved)
            loop.call_later(max(0.0, self._rendered_at + RENDER_EVERY_S - loop.time()), self._render_now, loop)
        return await asyncio.shield(self._next_render)

    def _render_now(self, loop: asyncio.AbstractEventLoop) -> None:
        done, self._next_render = self._next_render, None  # scrapes from here on wait for the next one
        self._rendered_at = loop.time()
        assert done is not None
        try:
            done.set_result(self.render())
        except Exception as exc:  # noqa: BLE001 - every waiting scrape's, each answers it
            done.set_exception(exc)

    async def watch_loop(self) -> None:
        """Measure the running event loop's lag until cancelled: a timer every LOOP_TICK, and how late it ran."""
        loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_native_id()
        longest = 0.0
        while True:
            start = loop.time()
            await asyncio.sleep(LOOP_TICK)
            lag = max(0.0, loop.time() - start - LOOP_TICK)
            self.loop_lag.observe(lag)
            if lag > longest:
                longest = lag
                self.loop_lag_max.set(lag)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.request_seconds.labels(route, method).observe(seconds)

    def content_filtered(self, model: str, direction: str, categories: Iterable[str]) -> None:
        for category in categories:
            self.filtered.labels(model, direction, category).inc()

    def watch_batches(self, source: Callable[[], tuple[dict[str, int], int, int]]) -> None:
        """Collect the Batch API's counts from `source` (batches by status, lines succeeded, lines failed)."""
        self.registry.register(_BatchCollector(source))

    def watch_adapters(self, source: Callable[[], Iterable[tuple[str, str, bool, int]]]) -> None:
        """Collect the LoRA adapters' (model, adapter, loaded, requests) from `source`."""
        self.registry.register(_AdapterCollector(source))

    def watch_replicas(self, source: Callable[[], Iterable[tuple[str, int, Sequence[float]]]]) -> None:
        """Collect the Ray replicas' garbage-collector figures from `source`: (model, frozen objects, pause seconds
        by generation), added up over each deployment's replicas."""
        self.registry.register(_ReplicaGcCollector(source))

    def watch_models(self, source: Callable[[], Iterable[ModelCounts]]) -> None:
        """Collect the on-demand models' counts from `source` (servelm/fleet.py's Fleet.counts)."""
        self.registry.register(_ModelCollector(source))

    def meter(self, model: str) -> GenerationMeter:
        return GenerationMeter(self, model)

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)


def _retrieved(render: asyncio.Future[bytes]) -> None:
    """A render's failure with no scrape left to read it is not logged as never retrieved (each scrape logs its own)."""
    if not render.cancelled():
        render.exception()


class GenerationMeter:
    """One deployment's generation timings and token counts (its labelled children, looked up once)."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self._metrics = metrics
        self._model = model
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)
        self._e2e = metrics.e2e.labels(model)
        self._prompt = metrics.prompt_tokens.labels(model)
        self._generated = metrics.generation_tokens.labels(model)

    def first_output(self, seconds: float, prompt_tokens: int, queued: float, priority: int) -> None:
        self._ttft.observe(seconds)
        self._prompt.inc(prompt_tokens)
        label = str(priority) if -10 <= priority <= 10 else ("<-10" if priority < 0 else ">10")
        self._metrics.queue.labels(self._model, label).observe(queued)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, seconds: float, completion_tokens: int, outcome: str) -> None:
        """outcome: "completed", "aborted" (the client went away or the request was cancelled) or "failed"."""
        self._e2e.observe(seconds)
        self._generated.inc(completion_tokens)
        self._metrics.generations.labels(self._model, outcome).inc()
