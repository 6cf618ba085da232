"""`servelm serve --help` documents every setting."""

from __future__ import annotations

import re

import pytest

from servelm.__main__ import main
from servelm.config import EngineSettings, ServerSettings


@pytest.fixture(scope="module")
def serve_help() -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    return out.getvalue()


def settings():
    for name, field in ServerSettings.model_fields.items():
        if name != "engine":
            yield name, field
    yield from EngineSettings.model_fields.items()


@pytest.mark.parametrize("name, field", list(settings()), ids=[n for n, _ in settings()])
def test_every_setting_has_a_flag_and_a_help_text(serve_help, name, field):
    assert field.description and len(field.description) > 8, f"{name} has no description"
    flag = "--" + name.replace("_", "-")
    assert re.search(rf"^\s+{re.escape(flag)}\b", serve_help, re.M), f"{flag} is not in `servelm serve --help`"
    # the help text follows the flag (argparse wraps it: compare its first words)
    first_words = " ".join(field.description.split()[:3])
    assert first_words in " ".join(serve_help.split()), f"{flag}'s help text is missing"


def test_help_names_the_environment_variables_and_defaults(serve_help):
    text = " ".join(serve_help.split())
    assert "SERVELM_" in text
    assert "--port PORT port to listen on (default: 8000)" in text
    assert "(default: 10.0)" in text  # --shutdown-timeout


def test_help_shows_no_placeholder_defaults(serve_help):
    assert "PydanticUndefined" not in serve_help and "None)" not in serve_help


def test_a_start_imports_no_sdk_it_does_not_use():
    """What `servelm serve` imports to build its app and deployments leaves out the MCP SDK (a second of imports,
    loaded on a thread when a Responses request first reaches an MCP server), Ray, vLLM and OpenTelemetry's SDK."""
    import subprocess
    import sys

    code = ("import sys, servelm.__main__, servelm.compose, servelm.fleet, servelm.http.app; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mcp', 'mcp_types', 'ray', 'vllm'}), "
            "'opentelemetry.sdk' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "False"], done.stdout
