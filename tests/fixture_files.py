"""Test fixtures written by the project's scripts (scripts/make_test_lora.py, make_test_reranker.py,
make_test_projector.py), run as a test needs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def write_fixture(script: str, out: Path, *args: str) -> Path:
    """Run scripts/SCRIPT to write OUT (with its further arguments); OUT."""
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / script), str(out), *args], check=True,
                   capture_output=True)
    return out
