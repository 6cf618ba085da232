"""`servelm batch -i IN.jsonl -o OUT.jsonl`: a batch file (OpenAI's line format, as vLLM's run-batch reads it) run
on this machine's engines with no HTTP server (`--ray`: over engine actors on a Ray cluster, servelm/ray/batch.py).

Every line goes through the same app a server runs (http/batches.AppCaller), so its answer is the one the endpoint
would give. Answers are appended to OUT as they come, each line whole and flushed; a run that stops is started again
with the same OUT and runs only the lines it does not hold yet (a last line cut short is dropped and run again).
Successes and failures go to OUT alike, each with its status code, as vLLM's run-batch writes them."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from servelm.batch.lines import BatchLine, MalformedFile, requests, validate
from servelm.batch.runner import answer
from servelm.config import ServerSettings

log = logging.getLogger("servelm.batch")
MAX_LINES = 10_000_000  # an offline file is bounded by the disk, not by a server's limits


def pending(lines: list[BatchLine], output: Path) -> list[BatchLine]:
    """The lines OUT does not answer yet; a last line cut short (a run killed mid-write) is removed from OUT."""
    if not output.exists():
        return lines
    raw = output.read_bytes()
    whole = raw[: raw.rfind(b"\n") + 1]
    if len(whole) != len(raw):
        with open(output, "r+b") as f:
            f.truncate(len(whole))
    done = set()
    for text in whole.decode("utf-8", "replace").splitlines():
        try:
            done.add(json.loads(text)["custom_id"])
        except (ValueError, KeyError, TypeError):
            continue
    return [line for line in lines if line.custom_id not in done]


def read_lines(path: Path, max_line_bytes: int = 8 << 20) -> list[BatchLine]:
    """A batch file's requests, checked first a line at a time (each line at most `max_line_bytes`,
    --max-body-bytes)."""
    try:
        with open(path, "rb") as f:
            validate(f, None, MAX_LINES, max_line_bytes)
            f.seek(0)
            return [line for _, line in requests(f, None, max_line_bytes) if isinstance(line, BatchLine)]
    except MalformedFile as exc:
        problems = "\n".join(f"  line {e.line}: {e.message}" if e.line else f"  {e.message}" for e in exc.errors)
        raise SystemExit(f"servelm batch: {path} is not a batch file:\n{problems}") from None


class Appender:
    """OUT, one whole line at a time, flushed and synced: what it holds survives a kill."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "ab")  # noqa: SIM115 (closed by close())

    def write(self, text: str) -> None:
        self.file.write(text.encode() + b"\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


class LocalLines:
    """This process's engines behind the server's own app, and the lines run through it."""

    def __init__(self, settings: ServerSettings, verbose_llama: bool = False) -> None:
        from servelm.compose import Plan
        from servelm.http.app import AppOptions, create_app
        from servelm.http.batches import AppCaller

        plan = Plan.read(settings, verbose_llama=verbose_llama, serving=False)
        self.built = plan.builder().build(plan.specs, plan.endpoints)
        self.built.start()
        app = create_app(self.built.deployments, AppOptions(playground=False))
        self.caller = AppCaller(app)
        self.width = sum(d.engine.stats().total_slots for d in self.built.deployments.generators()) or 1

    def close(self) -> None:
        self.built.stop()
        self.built.close()

    async def answer_all(self, lines: list[BatchLine], on_done: Callable[[str], None], priority: int = 0) -> None:
        """Each line's output line to `on_done`, in the order they finish, with every slot busy."""
        todo = iter(lines)

        async def work() -> None:
            for line in todo:
                result = await answer(self.caller, line, line.url, "", priority)
                on_done(result.output)

        await asyncio.gather(*(work() for _ in range(min(self.width, max(1, len(lines))))))


def run_local(settings: ServerSettings, source: Path, output: Path, verbose_llama: bool = False) -> int:
    from tqdm import tqdm

    lines = read_lines(source, settings.max_body_bytes)
    todo = pending(lines, output)
    log.info("%d of %d lines to run (%d answered in %s already)", len(todo), len(lines), len(lines) - len(todo),
             output)
    if not todo:
        return 0
    logging.getLogger("servelm.access").setLevel(logging.WARNING)  # the progress bar says it
    engines = LocalLines(settings, verbose_llama)
    out = Appender(output)
    try:
        with tqdm(total=len(lines), initial=len(lines) - len(todo), unit="line", desc="batch") as bar:
            def done(text: str) -> None:
                out.write(text)
                bar.update(1)

            asyncio.run(engines.answer_all(todo, done))
    finally:
        out.close()
        engines.close()
    return 0
