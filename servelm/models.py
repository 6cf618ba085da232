"""Where a deployment's model file comes from: the embedded models, a path, or a Hugging Face repo (downloaded
with huggingface_hub, when it is installed)."""

from __future__ import annotations

import re
from pathlib import Path

from servelm.config import DEFAULT_EMBEDDING_MODEL_ID, DEFAULT_MODEL_ID, GEMMA_MODEL_ID, embedded_embedding_model_path, embedded_model_path, gemma_model_path


def resolve_model_source(source: str, kind: str) -> Path:
    """A deployment's `model` → a GGUF file on this machine."""
    if source in (DEFAULT_MODEL_ID, "smollm2", "embedded"):
        return embedded_model_path()
    for name, where in ((DEFAULT_EMBEDDING_MODEL_ID, embedded_embedding_model_path), (GEMMA_MODEL_ID, gemma_model_path)):
        if source == name:
            path = where()
            if not path.is_file():
                raise FileNotFoundError(f"the model {name} is not installed (run `make install`): {path}")
            return path
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"the model file does not exist: {path}")
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w./-]+\.gguf)?", source):
        return _from_hugging_face(source)
    raise ValueError(f"model {source!r} is neither an embedded model, a .gguf path nor a Hugging Face repo id")


def _from_hugging_face(source: str) -> Path:
    repo, _, filename = source.partition(":")
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError(f"model {source!r} is a Hugging Face repo id, but huggingface_hub is not installed") from None
    try:
        if not filename:
            ggufs = sorted(f for f in huggingface_hub.list_repo_files(repo) if f.endswith(".gguf"))
            if not ggufs:
                raise ValueError(f"the Hugging Face repo {repo!r} holds no .gguf file")
            filename = ggufs[0]
        return Path(huggingface_hub.hf_hub_download(repo, filename))
    except ValueError:
        raise
    except Exception as exc:  # no network, no such repo
        raise ValueError(f"could not fetch {source!r} from Hugging Face: {exc}") from None
