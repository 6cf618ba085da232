"""The command line: `servelm serve` reads the settings, loads the model, and starts uvicorn; `servelm bench` measures
any OpenAI-compatible server (servelm/bench/cli.py)."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, NoReturn, get_args

from pydantic import ValidationError

from servelm import __version__
from servelm.config import EngineSettings, ServerSettings, load_config_file
from servelm.errors import ApiError
from servelm.logs import configure as configure_logs

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from servelm.compose import Plan
    from servelm.fleet import Fleet
    from servelm.tracing import Tracing

log = logging.getLogger("servelm")


def _help(field: FieldInfo) -> str:
    """A setting's description, with its default when it has a plain one it does not already name."""
    text = field.description or ""
    default = field.default
    if default is None or field.default_factory is not None or isinstance(default, (list, dict)) or "default" in text \
            or default == "":
        return text
    shown = ("on" if default else "off") if isinstance(default, bool) else default
    return f"{text} (default: {shown})"


def _serve_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API", description="Serve the OpenAI-compatible API. "
                       "Every option can also be set with an environment variable SERVELM_<OPTION> (e.g. SERVELM_PORT).")
    _settings_arguments(p)
    p.add_argument("--verbose-llama", action="store_true", help="show llama.cpp's own log lines")
    p.add_argument("--ray", action="store_true", help="run on Ray Serve (pip install 'servelm[ray]'): each "
                   "deployment's replicas (num_replicas, min_replicas/max_replicas in --config) on a Ray cluster, "
                   "with prefix-affine routing")
    p.add_argument("--ray-address", default=None, help="with --ray: the Ray cluster to join (default: RAY_ADDRESS, "
                   "else a local Ray instance started for this server)")


def _batch_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("batch", help="run a batch file offline (OpenAI's batch lines, as vllm run-batch reads them)",
                       description="Run a JSONL batch file (OpenAI's Batch API lines: custom_id, method, url, body) on "
                       "this machine's engines with no HTTP server, or on a Ray cluster with --ray. Answers are "
                       "appended to the output file as they come; run it again with the same output file to go on "
                       "where it stopped. The serve options choose the models and engines.")
    p.add_argument("-i", "--input-file", dest="batch_input", required=True, help="the batch file to run")
    p.add_argument("-o", "--output-file", dest="batch_output", required=True, help="where the answers go (appended)")
    _settings_arguments(p)
    p.add_argument("--verbose-llama", action="store_true", help="show llama.cpp's own log lines")
    p.add_argument("--ray", action="store_true", help="map the lines over engine actors with Ray Data")
    p.add_argument("--ray-address", default=None, help="with --ray: the Ray cluster to join (default: RAY_ADDRESS, "
                   "else a local Ray instance)")
    p.add_argument("--actors", type=int, default=2, help="with --ray: engine actors, each with --threads CPUs "
                   "(default 1) (default: 2)")


def _settings_arguments(p: argparse.ArgumentParser) -> None:
    """A flag for every server and engine setting."""
    for name, field in ServerSettings.model_fields.items():
        if name == "engine":
            continue
        kind: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if field.annotation is bool else {}
        if getattr(field.annotation, "__origin__", None) is list:  # a repeatable flag (--api-key)
            kind = {"action": "append"}
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=_help(field), **kind)
    p.add_argument("--model", dest="model_path", default=None, help="alias of --model-path")
    for name, field in EngineSettings.model_fields.items():
        flag, dest = f"--{name.replace('_', '-')}", f"engine.{name}"
        if field.annotation is bool:
            p.add_argument(flag, dest=dest, default=None, action=argparse.BooleanOptionalAction, help=_help(field))
        elif getattr(field.annotation, "__origin__", None) is Literal:  # one of named values (--kv-cache-type)
            p.add_argument(flag, dest=dest, default=None, choices=get_args(field.annotation), help=_help(field))
        elif str in get_args(field.annotation):  # a path (--prefix-cache-dir)
            p.add_argument(flag, dest=dest, default=None, metavar="PATH", help=_help(field))
        else:
            p.add_argument(flag, dest=dest, default=None, type=int, metavar="N", help=_help(field))


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Flags over the config file's [server] table over SERVELM_* variables over defaults."""
    top = {k: v for k, v in vars(args).items() if v is not None and "." not in k and k in ServerSettings.model_fields}
    eng = {k.split(".", 1)[1]: v for k, v in vars(args).items() if v is not None and k.startswith("engine.")}
    if top.get("config"):
        server = dict(load_config_file(top["config"]).server)
        # engine settings may sit flat in [server], as their flags do, or in [server.engine]
        flat = {k: server.pop(k) for k in list(server) if k in EngineSettings.model_fields}
        eng = {**server.pop("engine", {}), **flat, **eng}
        top = {**server, **top}
    return ServerSettings(**top, engine=EngineSettings(**eng))


def invalid_setting(exc: Exception) -> str:
    """A bad setting in one line, naming its flag (the same name as a SERVELM_* variable or a [server] key): pydantic's
    errors without their types and links, and a value shown only when it is a number (a bad key or header value is
    never echoed)."""
    if not isinstance(exc, ValidationError):
        return " ".join(str(exc).split())
    said = []
    for error in exc.errors():
        name = next((str(part) for part in error["loc"] if isinstance(part, str)), "")
        flag = f"--{name.replace('_', '-')}" if name else "a setting"
        value = error.get("input")
        shown = f" {value}" if isinstance(value, (int, float)) or (isinstance(value, str) and _number(value)) else ""
        said.append(f"{flag}{shown}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(" ".join(line.split()) for line in said)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return len(text) <= 32


def serve(settings: ServerSettings, verbose_llama: bool = False, ray: bool = False,
          ray_address: str | None = None) -> None:
    from servelm.compose import Plan
    from servelm.http.app import AppOptions, create_app
    from servelm.http.server import run as run_server

    configure_logs(settings.log_level, settings.log_format)
    try:
        plan = Plan.read(settings, verbose_llama=verbose_llama)  # the keys hashed here: they themselves go no further
        if ray and any(s.mmproj for s in [*plan.specs, *plan.on_demand]):
            raise ValueError("--mmproj (images) is not served under --ray yet; serve the vision model without --ray")
        if ray:
            return _serve_on_ray(plan, ray_address)
        options = AppOptions.from_settings(settings, plan.keys, plan.mcp_servers)
        # the --state-dir database damaged, foreign or unwritable stops the start before any model loads
        state = options.batches.open() if options.batches is not None else None
    except (ValueError, OSError, RuntimeError, ApiError) as exc:  # a bad file, a missing model: say which
        raise SystemExit(f"servelm: {exc}") from None
    try:
        built = plan.builder().build(plan.specs, plan.endpoints)
        catalog = _fleet(plan) if plan.on_demand or settings.models_dir else None
    except (ValueError, OSError, RuntimeError, ApiError) as exc:
        if state is not None:
            state.close()
        raise SystemExit(f"servelm: {exc}") from None
    app = create_app(built.deployments, options, on_start=built.start, on_stop=built.stop, catalog=catalog,
                     tracing=_tracing(plan), state_store=state)
    names = ", ".join(repr(d.name) for d in built.deployments.all())
    if catalog is not None:
        names += (", " if names else "") + ", ".join(f"{n!r} (on demand)" for n in catalog.statuses())
    log.info("serving %s on http://%s:%s", names or "no model yet", settings.host, settings.port)
    # what was built before serving (the imports, the models, their vocabulary tables) lives as long as the server:
    # frozen out of every later collection, a full one reads only what came since (a tenth of a second with the GIL
    # held, every stream waiting, on the default model otherwise)
    gc.collect()
    gc.freeze()
    try:
        run_server(app, host=settings.host, port=int(settings.port), log_level=settings.log_level.lower(),
                   shutdown_timeout=settings.shutdown_timeout, header_timeout=settings.header_timeout,
                   body_timeout=settings.body_timeout,
                   keep_alive_timeout=settings.keep_alive_timeout, max_connections=settings.max_connections)
    finally:
        built.close()


def _tracing(plan: Plan) -> Tracing | None:
    """The OpenTelemetry exporter of --otlp-traces-endpoint (None: tracing off)."""
    from servelm.tracing import Tracing

    found = plan.trace_settings()
    return Tracing(found) if found is not None else None


def _fleet(plan: Plan) -> Fleet:
    """The models loaded when a request names them: --models-dir's and the config's on-demand deployments."""
    from servelm.fleet import Fleet, FleetLimits

    settings = plan.settings
    return Fleet(list(plan.on_demand), FleetLimits.of(settings), models_dir=settings.models_dir,
                 engine=settings.engine, builder=plan.builder().one)


def _serve_on_ray(plan: Plan, address: str | None) -> None:
    from servelm.compose import with_blocklist
    from servelm.fleet import scan_models_dir

    try:
        from servelm.ray.application import build_application, serve_on_ray
    except ImportError as exc:
        raise SystemExit(f"servelm: --ray needs Ray Serve (pip install 'servelm[ray]'): {exc}") from None

    settings = plan.settings
    if settings.models_dir is not None:  # scanned once: under Ray each model is a deployment of the application
        found, failed = scan_models_dir(settings.models_dir, settings.engine)
        for name, reason in failed.items():
            log.warning("--models-dir: %s is not served: %s", name, reason)
        for s in found:
            if s.mmproj is not None:
                log.warning("--models-dir: %s is not served under --ray (images are not, yet)", s.name)
        served = with_blocklist([s for s in found if s.mmproj is None], settings.content_blocklist)
        plan = replace(plan, on_demand=(*plan.on_demand, *served))
    serve_on_ray(build_application(plan), host=settings.host, port=int(settings.port), address=address)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors in one line naming the flag (and where the usage is), not the usage first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="servelm", description="An OpenAI-compatible LLM server over llama.cpp.")
    parser.add_argument("--version", action="version", version=f"servelm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _batch_parser(sub)
    from servelm.bench.cli import add_arguments

    add_arguments(sub.add_parser("bench", help="benchmark OpenAI-compatible servers (vllm bench serve's metrics)",
                                 description="Benchmark one or more OpenAI-compatible servers: TTFT, TPOT, ITL and "
                                 "E2EL, throughput and goodput, as vllm bench serve defines and names them."))
    args = parser.parse_args(argv)
    # a crash inside llama.cpp (or any native code) prints every thread's Python stack on stderr before the process
    # ends, so the log says where it happened
    try:
        faulthandler.enable()
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor (an embedding host's, a test's)
        pass
    if args.command == "bench":
        from servelm.bench.cli import main as bench

        return bench(args)
    if args.command == "serve":
        verbose, ray, ray_address = args.verbose_llama, args.ray, args.ray_address
        del args.verbose_llama, args.ray, args.ray_address
        try:
            settings = settings_from_args(args)
        except Exception as exc:
            print(f"servelm: invalid setting: {invalid_setting(exc)}", file=sys.stderr)
            return 2
        serve(settings, verbose, ray, ray_address)
    if args.command == "batch":
        return _batch(args)
    return 0


def _batch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from servelm.offline import run_local

    source, output, verbose, ray, address, actors = (Path(args.batch_input), Path(args.batch_output),
                                                     args.verbose_llama, args.ray, args.ray_address, args.actors)
    for name in ("batch_input", "batch_output", "verbose_llama", "ray", "ray_address", "actors"):
        delattr(args, name)
    try:
        settings = settings_from_args(args)
    except Exception as exc:
        print(f"servelm: invalid setting: {invalid_setting(exc)}", file=sys.stderr)
        return 2
    configure_logs(settings.log_level, settings.log_format)
    if not source.is_file():
        print(f"servelm batch: no such file: {source}", file=sys.stderr)
        return 2
    if ray:
        try:
            from servelm.ray.batch import run_on_ray
        except ImportError as exc:
            raise SystemExit(f"servelm: batch --ray needs Ray Data (pip install 'servelm[ray]'): {exc}") from None
        return run_on_ray(settings, source, output, actors, address)
    return run_local(settings, source, output, verbose)


if __name__ == "__main__":
    sys.exit(main())
