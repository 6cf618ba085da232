"""Write a small vision projector GGUF for the embedded SmolLM2-135M-Instruct: a TEST FIXTURE, not a vision model.

    .venv/bin/python scripts/make_test_projector.py OUT [--model MODEL.gguf] [--side N]

No package on the registries these machines reach ships a vision-language model, so the tests of servelm's image
path (data URL → libmtmd → the engine → an answer) run on this: a projector of llama.cpp's `gemma3` type (its
image markers, `<start_of_image>` and `<end_of_image>`, are plain text to SmolLM2's vocabulary), with no vision
transformer layers. What it computes, by construction:
- the patch embedding averages each 8 x 8 patch's red, green and blue (4 features: r, g, b and a constant 1, from
  the bias), with mean 0 and std 1, so pixels read as 0..1;
- gemma3's pooling averages 2 x 2 patches, then an RMS norm;
- the projection maps those 4 features to SmolLM2's 576-wide input, fitted by least squares so that a solid red,
  green, blue or white image lands exactly on the embedding of the word " red", " green", " blue" or " white".
So an image (resized by llama.cpp to 32 x 32 pixels) becomes 2 x 2 = 4 tokens that read like the colour's name:
the model can tell solid colours apart. Anything else it sees is a blend of those four words. `--side N` makes an
image N x N tokens instead (harness/images.py measures what a large image's decode costs the other streams).

The weights are written with the `gguf` package; the model's token embeddings are read from the model file (Q8_0,
dequantized with gguf's own code).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

PATCH = 8  # pixels a patch side
MERGE = 2  # gemma3's average pooling: 2 x 2 patches a token
WIDTH = 4  # the vision side's features: r, g, b, 1
COLOURS = {" red": (1, 0, 0), " green": (0, 1, 0), " blue": (0, 0, 1), " white": (1, 1, 1)}
EPS = 1e-6


def _features(rgb: tuple[float, float, float]) -> np.ndarray:
    """What the projection sees for a solid colour: [r, g, b, 1] after gemma3's RMS norm."""
    x = np.array([*rgb, 1.0], dtype=np.float64)
    return x / np.sqrt(np.mean(x * x) + EPS)


def _token_embeddings(model: Path, words: list[str]) -> tuple[np.ndarray, int]:
    reader = gguf.GGUFReader(str(model))
    field = reader.fields["tokenizer.ggml.tokens"]
    ids = {bytes(field.parts[i]).decode("utf-8", errors="replace"): n for n, i in enumerate(field.data)}
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rows = []
    for word in words:
        token = word.replace(" ", "\u0120")  # GPT-2 byte-level BPE writes a leading space as Ġ
        if token not in ids:
            raise SystemExit(f"the model's vocabulary has no single token for {word!r}")
        rows.append(ids[token])
    embd = gguf.quants.dequantize(table.data, table.tensor_type).reshape(-1, table.shape[0])
    return embd[rows].astype(np.float64), int(table.shape[0])


def build(out: Path, model: Path, side: int = 2) -> None:
    targets, _ = _token_embeddings(model, list(COLOURS))
    inputs = np.stack([_features(rgb) for rgb in COLOURS.values()])
    proj, *_ = np.linalg.lstsq(inputs, targets, rcond=None)  # (WIDTH, n_embd): features @ proj ≈ the word
    write(out, proj.astype(np.float32), side)


def write(out: Path, proj: np.ndarray, side: int = 2) -> None:
    """The projector file with this projection (WIDTH x the text model's width); an image is side x side tokens."""
    n_embd = proj.shape[1]
    patch = np.zeros((WIDTH, 3, PATCH, PATCH), dtype=np.float32)  # ggml conv kernel [KW, KH, C_in, C_out]
    for c in range(3):
        patch[c, c] = 1.0 / (PATCH * PATCH)
    bias = np.array([0, 0, 0, 1], dtype=np.float32)

    w = gguf.GGUFWriter(str(out), "clip")
    w.add_string("general.name", "servelm test projector (solid colours; not a vision model)")
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", PATCH * MERGE * side)  # llama.cpp resizes every image to this square
    w.add_uint32("clip.vision.patch_size", PATCH)
    w.add_uint32("clip.vision.projector.scale_factor", MERGE)
    w.add_uint32("clip.vision.embedding_length", WIDTH)
    w.add_uint32("clip.vision.feed_forward_length", WIDTH)
    w.add_uint32("clip.vision.block_count", 0)
    w.add_uint32("clip.vision.projection_dim", n_embd)
    w.add_uint32("clip.vision.attention.head_count", 1)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", EPS)
    w.add_array("clip.vision.image_mean", [0.0, 0.0, 0.0])
    w.add_array("clip.vision.image_std", [1.0, 1.0, 1.0])
    w.add_tensor("v.patch_embd.weight", patch)
    w.add_tensor("v.patch_embd.bias", bias)
    w.add_tensor("mm.soft_emb_norm.weight", np.ones(WIDTH, dtype=np.float32))
    w.add_tensor("mm.input_projection.weight", proj)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="where to write the projector GGUF")
    ap.add_argument("--model", type=Path, default=None, help="the text model (default: the embedded SmolLM2)")
    ap.add_argument("--side", type=int, default=2, help="an image is side x side tokens (default 2)")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from servelm.config import embedded_model_path

        model = embedded_model_path()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    build(args.out, model, args.side)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
