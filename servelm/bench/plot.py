"""The figure of a `servelm bench` run: latency CDFs and throughput against load, one line per server."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Run:
    """One server at one load level: its label, the level's load (concurrency or rate) and its result dict."""

    server: str
    load: float
    result: dict[str, Any]


def _cdf(ax: Any, values_ms: Sequence[float], label: str, colour: str, dash: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), dash, color=colour, label=label, drawstyle="steps-post")


def _values_ms(result: dict[str, Any], key: str) -> list[float]:
    """A metric's values of the successful requests, in ms (ITL: every gap; TTFT: streamed requests only)."""
    ok = [not e for e in result["errors"]]
    if key == "itls":
        return [g * 1000 for gaps, good in zip(result[key], ok) if good for g in gaps]
    return [v * 1000 for v, good in zip(result[key], ok) if good and v > 0]


def figure(runs: Sequence[Run], load_label: str, path: Path, title: str) -> Path:
    """Write a PNG of 2 × 2 panels: the CDFs of TTFT, ITL and E2EL (each server at each level), and output tokens/s
    against load (one line per server)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r.server for r in runs))
    loads = sorted({r.load for r in runs})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    dashes = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    panels = (("TTFT", "ttfts", axes[0][0]), ("ITL", "itls", axes[0][1]), ("E2EL", "latencies", axes[1][0]))
    for name, key, ax in panels:
        for r in runs:
            _cdf(ax, _values_ms(r.result, key), f"{r.server} · {load_label} {r.load:g}",
                 colours[servers.index(r.server) % len(colours)], dashes[loads.index(r.load) % len(dashes)])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of gaps" if key == "itls" else "fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[1][1]
    for i, server in enumerate(servers):
        mine = sorted((r for r in runs if r.server == server), key=lambda r: r.load)
        ax.plot([r.load for r in mine], [r.result["output_throughput"] for r in mine], "o-",
                color=colours[i % len(colours)], label=server)
    ax.set_xlabel(load_label)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Output throughput against {load_label}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
