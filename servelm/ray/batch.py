"""`servelm batch --ray`: a batch file's lines mapped over engine actors with Ray Data, each actor one servelm
engine (every deployment of the settings, its own llama.cpp threads) answering blocks of lines through the server's
own app (servelm/offline.py's LocalLines), its answers appended to the output file as they come back."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import ray

from servelm.batch.lines import BatchLine
from servelm.config import ServerSettings
from servelm.offline import Appender, LocalLines, pending, read_lines


class EngineActor:
    """A Ray Data worker: one servelm engine (every deployment of the settings) answering batches of lines."""

    def __init__(self, settings: dict[str, Any]) -> None:
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("servelm").setLevel(logging.WARNING)
        self.engines = LocalLines(ServerSettings.model_validate(settings))
        self.loop = asyncio.new_event_loop()  # one for the app's life: its events belong to the loop that made them

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        lines = [BatchLine(int(n), c, json.loads(b), u) for n, c, b, u in
                 zip(batch["number"], batch["custom_id"], batch["body"], batch["url"], strict=True)]
        outputs: list[str] = []
        self.loop.run_until_complete(self.engines.answer_all(lines, outputs.append))
        return {"output": outputs}


def run_on_ray(settings: ServerSettings, source: Path, output: Path, actors: int, address: str | None) -> int:
    """Map the lines over `actors` engine actors with Ray Data (each reserves --threads CPUs, default 1), writing
    their answers to OUT as they come back."""
    from tqdm import tqdm

    lines = read_lines(source)
    todo = pending(lines, output)
    if not todo:
        return 0
    threads = settings.engine.threads or 1
    engine = settings.engine.model_copy(update={"threads": threads})
    config = settings.model_copy(update={"engine": engine}).model_dump(mode="json")
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    rows = [{"number": line.number, "custom_id": line.custom_id, "body": json.dumps(line.body), "url": line.url}
            for line in todo]
    # a block fills one engine's slots, and every actor gets blocks
    per_actor = max(1, min(engine.max_num_seqs, -(-len(rows) // actors)))
    data = ray.data.from_items(rows, override_num_blocks=-(-len(rows) // per_actor))
    answers = data.map_batches(EngineActor, fn_constructor_args=(config,), batch_size=per_actor,
                               compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=threads)
    out = Appender(output)
    try:
        with tqdm(total=len(lines), initial=len(lines) - len(todo), unit="line", desc="batch") as bar:
            for row in answers.iter_rows():
                out.write(row["output"])
                bar.update(1)
    finally:
        out.close()
    return 0
