"""API keys: loaded once and kept only as SHA-256 digests (http/auth.py checks them).

Keys come from --api-key (repeatable; SERVELM_API_KEY takes a comma-separated list), from --api-key-file
(one a line), and from the config file's [[keys]] tables. A line of the file, or a table, may limit the key:

    sk-alpha                                   # any deployment, the server's rate limits
    sk-beta deployments=smollm2,minilm rpm=60 tpm=20000 max_waiting=16 min_priority=-10 weight=2 max_share=0.5
    sha256:6b86b273ff34fce19d6b804eff5a3f57...  deployments=smollm2   # the key's digest, not the key

    [[keys]]                                   # in the config file
    key = "sk-gamma"                           # or key_sha256 = "6b86…"
    deployments = ["smollm2"]
    rpm = 60
    tpm = 20000
    max_waiting = 16                           # places in a deployment's waiting queue (--max-waiting-per-key)
    min_priority = -10                         # the most urgent priority it may ask for (default 0; admin: any)
    weight = 2                                 # its share of the tokens when slots are contended (default 1)
    max_share = 0.5                            # the fraction of a deployment's slots it may hold at once (default 1)
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # the priorities a request may carry (protocol/common.py's)
MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0  # a key's weight in the slots' fair share


@dataclass(frozen=True)
class KeySpec:
    digest: bytes  # SHA-256 of the key: the key itself is never kept
    deployments: frozenset[str] | None = None  # the model names it may use; None: all
    rpm: int | None = None  # requests per minute; None: the server's --rate-limit-rpm; 0: none
    tpm: int | None = None  # tokens per minute; None: the server's --rate-limit-tpm; 0: none
    name: str = ""  # a label for logs
    max_waiting: int | None = None  # places it may hold in a deployment's queue; None: --max-waiting-per-key
    monitor: bool = False  # it reads /metrics and /health's every counter (an operator's; --monitor-key)
    admin: bool = False  # it loads, unloads and rescans models (--admin-key)
    min_priority: int | None = None  # the most urgent priority its requests may ask for; None: 0 (an admin key: any)
    weight: float = 1.0  # its share of the tokens against other keys' while slots are contended (engine/fairness.py)
    max_share: float = 1.0  # the fraction of a deployment's slots its sequences may hold at once

    @property
    def label(self) -> str:
        return self.name or f"key-{self.digest.hex()[:8]}"

    @property
    def priority_floor(self) -> int | None:
        """The most urgent priority its requests may ask for (lower is more urgent): its own min_priority, else 0,
        so that only keys granted it go below the default; an admin key's is none."""
        if self.admin and self.min_priority is None:
            return None
        return 0 if self.min_priority is None else self.min_priority


MAX_NAME = 64  # a key's name labels its metrics' series and its log lines
RESERVED_NAMES = frozenset({"other", "server"})  # engine/fairness.py's series for the tenants past the first 64, and
# for the server's own work


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_spec(key: str | None = None, *, sha256: str | None = None, deployments: Iterable[str] | None = None,
             rpm: int | None = None, tpm: int | None = None, name: str = "",
             max_waiting: int | None = None, monitor: bool = False, admin: bool = False,
             min_priority: int | None = None, weight: float = 1.0, max_share: float = 1.0) -> KeySpec:
    """A KeySpec from a key or its digest (hex); a ValueError says what is wrong."""
    if (key is None) == (sha256 is None):
        raise ValueError("a key needs exactly one of `key` and `key_sha256`")
    if key is not None:
        if not key.strip() or key != key.strip():
            raise ValueError("an API key may not be empty or begin or end with spaces")
        digest = hash_key(key)
    else:
        try:
            digest = bytes.fromhex(sha256 or "")
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError("key_sha256 must be 64 hexadecimal digits (a SHA-256 digest)")
    for limit in (rpm, tpm, max_waiting):
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError("rpm, tpm and max_waiting must be whole numbers >= 0")
    if not isinstance(monitor, bool) or not isinstance(admin, bool):
        raise ValueError("monitor and admin must be true or false")
    if min_priority is not None and (not isinstance(min_priority, int) or isinstance(min_priority, bool)
                                     or not MIN_PRIORITY <= min_priority <= MAX_PRIORITY):
        raise ValueError(f"min_priority must be a whole number from {MIN_PRIORITY} to {MAX_PRIORITY}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ValueError(f"weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}")
    if isinstance(max_share, bool) or not isinstance(max_share, (int, float)) or not 0 < max_share <= 1:
        raise ValueError("max_share must be a fraction of the slots above 0 and at most 1")
    if not isinstance(name, str) or len(name) > MAX_NAME or not name.isprintable() or name in RESERVED_NAMES:
        raise ValueError(f"name must be at most {MAX_NAME} printable characters, and not "
                         f"{' or '.join(map(repr, sorted(RESERVED_NAMES)))} (the metrics' own tenants)")
    names = None if deployments is None else frozenset(deployments)
    return KeySpec(digest, names, rpm, tpm, name, max_waiting, monitor, admin, min_priority, float(weight),
                   float(max_share))


def key_from_table(table: Mapping[str, Any]) -> KeySpec:
    """A config file's [[keys]] table: key or key_sha256, and optionally deployments, rpm, tpm, max_waiting,
    min_priority, weight, max_share, name, monitor, admin."""
    unknown = set(table) - {"key", "key_sha256", "deployments", "rpm", "tpm", "max_waiting", "min_priority", "name",
                            "monitor", "admin", "weight", "max_share"}
    if unknown:
        raise ValueError(f"unknown field(s) in a [[keys]] table: {', '.join(sorted(unknown))}")
    deployments = table.get("deployments")
    if isinstance(deployments, str):
        deployments = [deployments]
    return key_spec(table.get("key"), sha256=table.get("key_sha256"), deployments=deployments,
                    rpm=table.get("rpm"), tpm=table.get("tpm"), name=str(table.get("name", "")),
                    max_waiting=table.get("max_waiting"), monitor=table.get("monitor", False),
                    admin=table.get("admin", False), min_priority=table.get("min_priority"),
                    weight=table.get("weight", 1.0), max_share=table.get("max_share", 1.0))


def parse_key_file(text: str, source: str = "the key file") -> list[KeySpec]:
    specs = []
    for number, raw in enumerate(text.split("\n"), 1):  # (splitlines() would split at a \r or \x1c inside a line)
        raw = raw.removesuffix("\r")
        if not raw.replace("\t", " ").isprintable():
            raise ValueError(f"{source}, line {number}: a control character (only printable text, spaces and tabs)")
        line = raw.split("#", 1)[0].strip()  # a key cannot hold `#`
        if not line:
            continue
        first, *options = line.split()
        fields: dict[str, Any] = {"key_sha256": first[7:]} if first.startswith("sha256:") else {"key": first}
        try:
            for option in options:
                name, sep, value = option.partition("=")
                if name in fields:
                    raise ValueError(f"{name} given twice")
                if option in ("monitor", "admin"):
                    fields[option] = True
                    continue
                if not sep or name not in ("deployments", "rpm", "tpm", "max_waiting", "min_priority", "name",
                                           "weight", "max_share"):
                    raise ValueError(f"expected deployments=a,b rpm=N tpm=N max_waiting=N min_priority=N weight=X "
                                     f"max_share=X name=TEXT, monitor or admin, not {option!r}")
                if not value:
                    raise ValueError(f"{name}= needs a value")
                if name == "deployments":
                    fields[name] = [d for d in value.split(",") if d]
                elif name == "name":
                    fields[name] = value
                elif name in ("weight", "max_share"):
                    fields[name] = _number(name, value)
                else:
                    fields[name] = _whole(name, value)
            specs.append(key_from_table(fields))
        except ValueError as exc:
            raise ValueError(f"{source}, line {number}: {exc}") from None
    return specs


_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")  # ASCII digits, no `_`
_WHOLE = re.compile(r"-?[0-9]{1,19}")


def _number(name: str, value: str) -> float:
    number = float(value) if _DECIMAL.fullmatch(value) else math.nan
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite decimal number such as 0.5, not {value!r}")
    return number


def _whole(name: str, value: str) -> int:
    if not _WHOLE.fullmatch(value):
        raise ValueError(f"{name} must be a whole number in ASCII digits, not {value!r}")
    return int(value)


class _KeySettings(Protocol):  # read-only: ServerSettings is frozen
    @property
    def api_key(self) -> list[str]: ...

    @property
    def api_key_file(self) -> Path | None: ...

    @property
    def monitor_key(self) -> list[str]: ...

    @property
    def admin_key(self) -> list[str]: ...


def load_keys(settings: _KeySettings, tables: Sequence[Mapping[str, Any]] = ()) -> list[KeySpec]:
    """Every key the settings name (flags, variable, file) plus the config file's [[keys]] tables."""
    specs = [key_spec(k) for k in settings.api_key]
    specs += [key_spec(k, deployments=(), monitor=True) for k in settings.monitor_key]  # reads metrics, runs nothing
    specs += [key_spec(k, admin=True) for k in settings.admin_key]  # any model, and loads and unloads them
    if settings.api_key_file is not None:
        path = Path(settings.api_key_file)
        specs += parse_key_file(path.read_text(encoding="utf-8"), str(path))
    for number, table in enumerate(tables, 1):
        try:
            specs.append(key_from_table(table))
        except ValueError as exc:
            raise ValueError(f"[[keys]] table {number}: {exc}") from None
    return specs
