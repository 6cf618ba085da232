"""The server's log lines: text (the default), or one JSON object a line (`--log-format json`) whose keys are the
record's time, level, logger and message and the fields a line carries (the access line's request_id, method,
path, status, duration_ms, trace_id, span_id)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELDS = ("request_id", "method", "path", "status", "duration_ms", "trace_id", "span_id")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        line.update({f: getattr(record, f) for f in FIELDS if getattr(record, f, None) is not None})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: str, fmt: str = "text") -> None:
    """The root logger's one handler, on stderr, in the chosen format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
