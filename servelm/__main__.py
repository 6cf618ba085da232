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
    )
    return deployment, engine


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API", description="Serve the OpenAI-compatible API. "
                       "Every option can also be set with an environment variable SERVELM_<OPTION> (e.g. SERVELM_PORT).")
    for name, field in ServerSettings.model_fields.items():
        if name == "engine":
            continue
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=field.description)
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
    app = create_app(Deployments([deployment]), on_start=engine.start, on_stop=engine.stop)
    log.info("serving %s as %r on http://%s:%s", path.name, settings.model_id, settings.host, settings.port)
    uvicorn.run(app, host=settings.host, port=int(settings.port), log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=10)
    runner.close()


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
