"""A Llama-shaped GGUF with random weights and a real tokenizer, for machines that cannot download a model.

The GPU check's machine has no network and only 64 MiB travel with a call, so its model is made there: the
tokenizer and chat template come from a small metadata-only GGUF made here (`vocab`, from the embedded SmolLM2),
the weights are drawn from N(0, 0.02). Its answers are noise; what it is for is speed and bitwise exactness.

    python -m harness.random_model vocab OUT.gguf [SOURCE.gguf]     # the tokenizer alone (default: SmolLM2's)
    python -m harness.random_model model OUT.gguf VOCAB.gguf --shape 1b
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

# name: (width, layers, attention heads, KV heads, feed-forward width)
SHAPES = {
    "tiny": (256, 2, 4, 2, 512),
    "135m": (576, 30, 9, 3, 1536),  # SmolLM2-135M's body
    "1b": (2048, 16, 32, 8, 8192),  # Llama-3.2-1B's body
    "3b": (3072, 28, 24, 8, 8192),  # Llama-3.2-3B's body
}


def _tokenizer(reader: GGUFReader) -> Iterator[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """The source's tokenizer.* keys: name, value, type and (for an array) its items' type."""
    for f in reader.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == GGUFValueType.ARRAY:
            item = f.types[-1]
            if item == GGUFValueType.STRING:
                yield f.name, [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data], kind, item
            else:
                yield f.name, [f.parts[i].tolist()[0] for i in f.data], kind, item
        elif kind == GGUFValueType.STRING:
            yield f.name, bytes(f.parts[f.data[0]]).decode("utf-8"), kind, None
        else:
            yield f.name, f.parts[f.data[0]].tolist()[0], kind, None


def _add_tokenizer(source: str, w: GGUFWriter) -> int:
    """Copies the tokenizer into `w`; returns its vocabulary's size."""
    size = 0
    for name, value, kind, item in _tokenizer(GGUFReader(source)):
        if kind == GGUFValueType.ARRAY and item == GGUFValueType.STRING:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, kind, item)
        if name == "tokenizer.ggml.tokens":
            size = len(value)
    return size


def _finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def vocab(out: str, source: str) -> None:
    w = GGUFWriter(out, "llama")
    size = _add_tokenizer(source, w)
    w.add_uint32("vocab.n_vocab", size)
    _finish(w)
    print(f"{out}: the tokenizer of {source}, {size} tokens")


def model(out: str, vocab_path: str, shape: str, seed: int) -> None:
    width, layers, heads, kv_heads, ff = SHAPES[shape]
    head = width // heads
    w = GGUFWriter(out, "llama")
    w.add_name(f"random-llama-{shape}")
    size = _add_tokenizer(vocab_path, w)
    w.add_context_length(8192)
    w.add_embedding_length(width)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(size)
    w.add_file_type(1)  # mostly F16: llama-quantize makes the other types from it
    rng = np.random.default_rng(seed)

    def weights(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(width, dtype=np.float32)

    w.add_tensor("token_embd.weight", weights(size, width))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", weights(size, width))  # its own: a random model with tied ones echoes its input
    for i in range(layers):
        for name, tensor in (("attn_norm", norm()), ("attn_q", weights(heads * head, width)),
                             ("attn_k", weights(kv_heads * head, width)), ("attn_v", weights(kv_heads * head, width)),
                             ("attn_output", weights(width, heads * head)), ("ffn_norm", norm()),
                             ("ffn_gate", weights(ff, width)), ("ffn_up", weights(ff, width)),
                             ("ffn_down", weights(width, ff))):
            w.add_tensor(f"blk.{i}.{name}.weight", tensor)
    _finish(w)
    print(f"{out}: random weights of shape {shape}, {size} tokens")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.random_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["vocab", "model"])
    ap.add_argument("out")
    ap.add_argument("source", nargs="?", help="vocab: a GGUF to take the tokenizer of (default: the embedded "
                    "SmolLM2); model: the vocab GGUF")
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.what == "vocab":
        if a.source is None:
            from servelm.config import embedded_model_path

            a.source = str(embedded_model_path())
        vocab(a.out, a.source)
    elif a.source is None:
        ap.error("model needs the vocab GGUF")
    else:
        model(a.out, a.source, a.shape, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
