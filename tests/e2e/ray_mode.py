"""SERVELM_E2E_RAY=1: the end-to-end contract suite through `servelm serve --ray` instead of the plain server.

Every server the suite starts (the session's, and those of tests that start their own with other flags) runs
on a local two-node Ray cluster of its own: a `ray.cluster_utils.Cluster` started here, in the pytest process
(every Ray process on 127.0.0.1), which the server joins with --ray-address; the session server's cluster
lives for the session, another one's until its server stops. The server's deployments are the ones the plain
server would run with the same flags (read by servelm's own parser), written into a config file with two
replicas of the default model and one of every other deployment, each replica on one thread (as tests/ray).

Without the switch nothing here imports Ray, and `through_ray_skip` marks skip nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .helpers import MODEL, RunningServer

ENABLED = os.environ.get("SERVELM_E2E_RAY", "") not in ("", "0")
REPLICAS = 2  # of the default model; every other deployment has one
NODES = 2
NODE = {"object_store_memory": 100 * 1024 * 1024, "node_ip_address": "127.0.0.1"}
STARTUP_TIMEOUT_S = 300.0  # a cluster's server: Serve's controller and proxy, the ingress, every replica's model
STOP_TIMEOUT_S = 60.0  # SIGTERM: the application is deleted (its replicas drain) before the process exits

if ENABLED:  # read by Ray at import and by every process it starts (the clusters' nodes inherit this environment)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # "this node" is 127.0.0.1, not the LAN address
    # the mode `servelm serve --ray` runs its own local instance in (servelm/ray/application.py: serve_on_ray)
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")

_clusters: dict[int, tuple[Any, Any]] = {}  # a server process's pid → (the process, its Cluster)


def through_ray_skip(reason: str) -> pytest.MarkDecorator:
    """Skip a test under SERVELM_E2E_RAY=1: it checks what holds of one process only (say why)."""
    return pytest.mark.skipif(ENABLED, reason=f"not through Ray (SERVELM_E2E_RAY=1): {reason}")


@contextmanager
def _without_servelm_env() -> Iterator[None]:
    """The plain server's settings come from its flags alone (start_server gives it no SERVELM_* variable)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SERVELM_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def _settings(flags: tuple[str, ...]) -> Any:
    from servelm.__main__ import _serve_parser, settings_from_args

    parser = argparse.ArgumentParser(prog="servelm")
    _serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *flags])
    for name in ("command", "verbose_llama", "ray", "ray_address"):
        delattr(args, name)
    return settings_from_args(args)


def _replicated(spec: Any) -> Any:
    engine = spec.engine.model_copy(update={"threads": spec.engine.threads or 1})
    replicas = REPLICAS if spec.name == MODEL and spec.max_replicas is None else spec.num_replicas
    return spec.model_copy(update={"engine": engine, "num_replicas": replicas})


def _drop_config(flags: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    skip = False
    for f in flags:
        if skip:
            skip = False
        elif f == "--config":
            skip = True
        elif not f.startswith("--config="):
            out.append(f)
    return out


def write_config(flags: tuple[str, ...], path: Path) -> tuple[list[str], int, int]:
    """Write the deployments the plain server would run with `flags`, replicated, to `path`; return the flags to
    start `servelm serve --ray` with (less the address), the default model's slots once every replica of it is
    up, and the CPUs the replicas reserve from Ray."""
    from servelm.compose import default_specs
    from servelm.config import load_config_file

    with _without_servelm_env():
        settings = _settings(flags)
        config = load_config_file(settings.config) if settings.config else None
        specs = config.deployments if config and config.deployments else default_specs(settings)
    specs = [_replicated(s) for s in specs]
    doc = config.model_dump(mode="json", exclude_none=True) if config else {}
    doc["deployments"] = [s.model_dump(mode="json", exclude_none=True) for s in specs]
    path.write_text(json.dumps(doc, indent=1), encoding="utf-8")  # JSON is YAML: a .yaml file, read as such
    slots = sum((s.num_replicas or 1) * s.engine.max_num_seqs for s in specs if s.name == MODEL)
    cpus = sum((s.num_replicas or s.min_replicas or 1) * s.engine.threads for s in specs)
    return [*_drop_config(flags), "--config", str(path), "--ray"], slots, cpus


def start_cluster(cpus: int) -> Any:
    """A local Ray cluster of NODES nodes that together offer `cpus` CPUs (each replica reserves its threads)."""
    from ray.cluster_utils import Cluster

    node = {**NODE, "num_cpus": max(1, math.ceil(cpus / NODES))}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        for _ in range(NODES - 1):
            cluster.add_node(**node)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def adopt(srv: RunningServer, cluster: Any) -> None:
    """`cluster` is `srv`'s: stopped by release(srv), or by reap() once the server exits by itself."""
    reap()
    _clusters[srv.process.pid] = (srv.process, cluster)


def release(srv: RunningServer) -> None:
    """Stop the cluster of a server that has been stopped."""
    _, cluster = _clusters.pop(srv.process.pid, (None, None))
    if cluster is not None:
        cluster.shutdown()


def reap() -> None:
    """Stop the clusters whose servers have exited (a test that sent SIGTERM itself)."""
    for pid, (proc, cluster) in list(_clusters.items()):
        if proc.poll() is not None:
            del _clusters[pid]
            cluster.shutdown()


def shutdown_all(stop: Any) -> None:
    """At the end of the session: every server still running is stopped (by `stop`), then its cluster."""
    while _clusters:
        _, (proc, cluster) = _clusters.popitem()
        try:
            stop(proc)
        finally:
            cluster.shutdown()
