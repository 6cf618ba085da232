"""Test fixtures written by the project's scripts (scripts/make_test_lora.py, make_test_reranker.py,
make_test_projector.py), run as a test needs them."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def write_fixture(script: str, out: Path, *args: str) -> Path:
    """Run scripts/SCRIPT to write OUT (with its further arguments); OUT."""
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / script), str(out), *args], check=True,
                   capture_output=True)
    return out


def reranker_scores(path: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """llama.cpp's rank pooling on each pair alone, in this process: the sigmoid of the one-score head's logit (what
    a reranker deployment should answer, up to the batch's rounding)."""
    from servelm.runners.llamacpp import LlamaCppEmbedder

    model = LlamaCppEmbedder(path, window=512, threads=1)
    try:
        assert model.cross_encoder and model.dim == 1
        return [1 / (1 + math.exp(-float(model.embed([model.tokenize_pair(q, d)])[0, 0]))) for q, d in pairs]
    finally:
        model.close()
