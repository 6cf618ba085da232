"""The GPU check's tools against bad input (found by the black-box attack): a file llama.cpp cannot load is a
failure, never a pass, and a missing one a usage error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _variants(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness.load_variants", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_a_file_llama_cpp_cannot_load_fails_every_variant(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model")
    done = _variants(str(bogus), "--imports", "--timeout", "60")
    assert done.returncode == 1, done.stdout[-2000:]
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("== ")]
    assert verdicts and all(line.endswith("exit 1") for line in verdicts), verdicts


def test_a_missing_file_is_a_usage_error(tmp_path):
    done = _variants(str(tmp_path / "missing.gguf"))
    assert done.returncode == 2 and "no such model file" in done.stderr
