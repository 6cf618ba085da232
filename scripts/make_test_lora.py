"""Write a small LoRA adapter GGUF for the embedded SmolLM2-135M-Instruct: a TEST FIXTURE, not a fine-tune.

    .venv/bin/python scripts/make_test_lora.py OUT [--model MODEL.gguf] [--rank 8] [--seed 0] [--strength 4]

No package on the registries these machines reach ships a LoRA adapter, so the tests of servelm's adapter path
(--lora, /v1/load_lora_adapter, `model: NAME`, concurrent adapters, the prefix cache per adapter) run on this: an
adapter of rank `--rank` on every layer's `ffn_down` and `attn_output` weights, its A and B matrices drawn from a
normal distribution seeded by `--seed` (each seed a different adapter), B scaled by `--strength` (at 4, a greedy
story from the embedded model takes another turn within its first tokens; the answer to a plain question of fact
does not change). It is written as llama.cpp's convert_lora_to_gguf.py
writes an adapter (general.type = adapter, adapter.type = lora, adapter.lora.alpha = rank, F32 `.lora_a` and
`.lora_b` tensors), with the base model's architecture, so llama.cpp loads it for that model and refuses it for
another. Its effect is visible: a greedy answer under the adapter differs from the base's.

A real adapter comes from a PEFT checkpoint: `python convert_lora_to_gguf.py ADAPTER_DIR --base BASE_DIR
--outtype f16` (llama.cpp's script; see the README).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import gguf
import numpy as np

TARGETS = re.compile(r"^blk\.\d+\.(ffn_down|attn_output)\.weight$")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", type=Path, default=None, help="the base model GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strength", type=float, default=4.0)
    args = ap.parse_args(argv)
    if args.model is None:
        from servelm.config import embedded_model_path

        args.model = embedded_model_path()
    reader = gguf.GGUFReader(args.model)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    rng = np.random.default_rng(args.seed)
    writer = gguf.GGUFWriter(str(args.out), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(args.rank))
    count = 0
    for tensor in reader.tensors:
        if not TARGETS.match(tensor.name):
            continue
        n_in, n_out = int(tensor.shape[0]), int(tensor.shape[1])  # ggml's order: ne0 is the input width
        a = rng.standard_normal((args.rank, n_in)) / np.sqrt(n_in)  # numpy's order: rows are ne1
        b = rng.standard_normal((n_out, args.rank)) * (args.strength * 0.05 / np.sqrt(args.rank))
        writer.add_tensor(f"{tensor.name}.lora_a", a.astype(np.float32))
        writer.add_tensor(f"{tensor.name}.lora_b", b.astype(np.float32))
        count += 1
    if not count:
        print(f"{args.model}: no ffn_down or attn_output weights to adapt", file=sys.stderr)
        return 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}: a rank-{args.rank} LoRA adapter of {count} {arch} weights (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
