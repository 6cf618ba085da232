"""The reference in docs/ builds as a MkDocs site in strict mode, as `make docs` builds it: a broken link, a
missing anchor or a page left out of the nav fails CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()

