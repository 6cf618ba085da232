"""The command line: `servelm serve` reads the settings, loads the model, and starts uvicorn."""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from collections.abc import Sequence

from servelm import __version__
from servelm.chat.template import ChatTemplate
from servelm.config import EngineSettings, ServerSettings
from servelm.service.deployments import Deployment

log = logging.getLogger("servelm")
EMBEDDING_SEQS = 64  # inputs one embedding pass may carry
EMBEDDING_WINDOW = 2048  # most tokens per input (and per pass) of an embedding model: attention is quadratic in it


def build_deployment(
    name: str,
    runner,
    fingerprint_source: str = "",
    seeded_step_tokens: int | None = None,
    prefix_cache: bool = False,
    chat_template: str | None = None,
) -> tuple[Deployment, object]:
    """Wrap a model runner in a LocalEngine and describe it as a deployment (the engine is not started)."""
    from servelm.chat.tools import detect_style
    from servelm.constrain.grammars import Grammars
    from servelm.engine.local import LocalEngine

    grammars = Grammars(runner.token_table(), runner.eog_ids, runner.tokenize_text)
    engine = LocalEngine(runner, seeded_step_tokens=seeded_step_tokens, prefix_cache=prefix_cache, grammars=grammars)
    bos = runner.bos_token
    template_source = chat_template or runner.chat_template

    def tokenize(text: str) -> list[int]:
        ids = runner.tokenize(text, add_special=True, parse_special=True)
        # a template that writes the BOS token itself must not get a second one from the tokenizer
        if bos and len(ids) > 1 and ids[0] == ids[1] and text.startswith(bos):
            ids = ids[1:]
        return ids

    digest = hashlib.sha256(f"{__version__}:{fingerprint_source or runner.description}".encode()).hexdigest()[:10]
    deployment = Deployment(
        name=name,
        engine=engine,
        template=ChatTemplate(template_source, bos_token=runner.bos_token, eos_token=runner.eos_token),
        tokenize=tokenize,
        context_window=runner.context_window,
        vocab_size=runner.vocab_size,
        max_choices=runner.num_slots,
        fingerprint=f"fp_{digest}",
        grammars=grammars,
        tool_style=detect_style(template_source),
        special_id=grammars.special_id,
        token_bytes=lambda t: grammars.spelled[t] if 0 <= t < len(grammars.spelled) else b"",
        tokenize_bare=lambda text, special: runner.tokenize(text, add_special=False, parse_special=special),
        fim_tokens=getattr(runner, "fim_tokens", None),
    )
    return deployment, engine


def build_embedding_deployment(name: str, model, fingerprint_source: str = "") -> tuple[Deployment, object]:
    """An embedding-only deployment over an embedding model (its EmbeddingEngine is not started)."""
    from servelm.engine.embedding import EmbeddingEngine

    embedder = EmbeddingEngine(model)
    digest = hashlib.sha256(f"{__version__}:{fingerprint_source or name}".encode()).hexdigest()[:10]
    deployment = Deployment(
        name=name,
        engine=None,
        template=None,
        tokenize=embedder.tokenize,
        context_window=embedder.context_window,
        vocab_size=embedder.vocab_size,
        max_choices=0,
        fingerprint=f"fp_{digest}",
        embedder=embedder,
    )
    return deployment, embedder


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API", description="Serve the OpenAI-compatible API. "
                       "Every option can also be set with an environment variable SERVELM_<OPTION> (e.g. SERVELM_PORT).")
    for name, field in ServerSettings.model_fields.items():
        if name == "engine":
            continue
        action = argparse.BooleanOptionalAction if field.annotation is bool else None
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, action=action, help=field.description)
    p.add_argument("--model", dest="model_path", default=None, help="alias of --model-path")
    for name, field in EngineSettings.model_fields.items():
        flag, dest = f"--{name.replace('_', '-')}", f"engine.{name}"
        if field.annotation is bool:
            p.add_argument(flag, dest=dest, default=None, action=argparse.BooleanOptionalAction, help=field.description)
        else:
            p.add_argument(flag, dest=dest, default=None, type=int, metavar="N", help=field.description)
    p.add_argument("--verbose-llama", action="store_true", help="show llama.cpp's own log lines")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    top = {k: v for k, v in vars(args).items() if v is not None and "." not in k and k in ServerSettings.model_fields}
    eng = {k.split(".", 1)[1]: v for k, v in vars(args).items() if v is not None and k.startswith("engine.")}
    return ServerSettings(**top, engine=EngineSettings(**eng))


def serve(settings: ServerSettings, verbose_llama: bool = False) -> None:
    import uvicorn

    from servelm.http.app import create_app
    from servelm.runners.llamacpp import LlamaCppRunner
    from servelm.service.deployments import Deployments

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = settings.resolved_model_path()
    e = settings.engine
    log.info("loading %s", path)
    runner = LlamaCppRunner(
        path, num_slots=e.max_num_seqs, kv_cells=e.kv_cells, max_step_tokens=max(e.max_step_tokens, e.max_num_seqs),
        context_window=e.context_window, threads=e.threads, verbose=verbose_llama,
    )
    deployment, engine = build_deployment(
        settings.model_id, runner, f"{path.name}:{path.stat().st_size}", seeded_step_tokens=e.seeded_step_tokens,
        prefix_cache=e.prefix_cache, chat_template=settings.read_chat_template(),
    )
    deployments = [deployment]
    workers: list = [engine]
    embedders = _add_embedding(settings, runner, deployments, workers, verbose_llama)

    def start() -> None:
        for w in workers:
            w.start()

    def stop() -> None:
        for w in workers:
            w.stop()

    app = create_app(Deployments(deployments), on_start=start, on_stop=stop)
    log.info("serving %s on http://%s:%s", ", ".join(repr(d.name) for d in deployments), settings.host, settings.port)
    try:
        uvicorn.run(app, host=settings.host, port=int(settings.port), log_level=settings.log_level.lower(),
                    timeout_graceful_shutdown=10)
    finally:
        for embedder in embedders:  # their contexts first: the chat one uses the runner's model
            embedder.close()
        runner.close()


def _add_embedding(settings: ServerSettings, runner, deployments: list[Deployment], workers: list,
                   verbose_llama: bool) -> list:
    """Give the chat deployment an embedder and add the embedding deployment, as the settings ask.
    Returns the llama.cpp embedders to close after serving."""
    from servelm.engine.embedding import EmbeddingEngine
    from servelm.runners.llamacpp import LlamaCppEmbedder

    threads = settings.engine.threads
    embedders: list = []
    if settings.chat_embedding_window:
        window = min(settings.chat_embedding_window, runner.context_window)
        chat = LlamaCppEmbedder(share=runner, pooling="mean", window=window, max_seqs=EMBEDDING_SEQS, threads=threads)
        embedders.append(chat)
        deployments[0].embedder = EmbeddingEngine(chat)
        workers.append(deployments[0].embedder)
    path = settings.resolved_embedding_model_path()
    if path is None:
        if settings.embedding_model and settings.embedding_model_path is None:
            log.warning("the embedding model is not installed (run `make install`); serving no %r",
                        settings.embedding_model_id)
        return embedders
    log.info("loading %s", path)
    model = LlamaCppEmbedder(path, window=EMBEDDING_WINDOW, max_seqs=EMBEDDING_SEQS, threads=threads,
                             verbose=verbose_llama)
    embedders.append(model)
    fingerprint = f"{path.name}:{path.stat().st_size}"
    deployment, engine = build_embedding_deployment(settings.embedding_model_id, model, fingerprint)
    deployments.append(deployment)
    workers.append(engine)
    return embedders


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="servelm", description="An OpenAI-compatible LLM server over llama.cpp.")
    parser.add_argument("--version", action="version", version=f"servelm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        verbose = args.verbose_llama
        del args.verbose_llama
        try:
            settings = settings_from_args(args)
        except Exception as exc:  # pydantic's message names the setting
            print(f"servelm: invalid setting: {exc}", file=sys.stderr)
            return 2
        serve(settings, verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
