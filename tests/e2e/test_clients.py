"""The client guide (docs/clients.md), run as written: every snippet, with the server's address put in
place of http://localhost:8000 (and the real MCP server's, which the session's server may reach, in place of
http://localhost:8931), in a process of its own (Python snippets with this venv's Python, JavaScript ones
with Node and the `openai` package scripts/install.sh puts in .venv/node)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mcp_servers import McpHttpServer

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NODE_DIR = REPO / ".venv" / "node"  # holds node_modules/openai
GUIDE_MCP_ORIGIN = "http://localhost:8931"  # where the guide's MCP server runs


def snippets() -> list[tuple[str, str, str]]:
    """(client, language, code) of every fenced block of the guide, by its "## client" section."""
    guide = (REPO / "docs" / "clients.md").read_text()
    found = []
    for part in guide.split("\n## ")[1:]:
        name = part.splitlines()[0].strip()
        for lang, code in re.findall(r"```(python|js)\n(.*?)```", part, re.S):
            found.append((name, lang, code))
    return found


SNIPPETS = snippets()
# what each snippet's output must show, beyond running without an error
EXPECT = {
    "LangChain": r"\n384\n",
    "instructor": r"name=",
    "pydantic-ai": r"name=",
    "azure-ai-inference": r"\n384\n",
    "OpenAI Agents SDK": r"Sunny in",  # the tool ran, and its answer is the final output
    "Anthropic SDK": r"(end_turn|max_tokens)\n\d+\n",
    "MCP tools": r"\nadd \{.*\} -> ",  # checked further by ran_add
}


def ran_add(output: str) -> None:
    """Each `add ARGUMENTS -> OUTPUT` line the MCP snippets print shows the add tool's real output: the sum."""
    for args, result in re.findall(r"^add (\{.*\}) -> (.*)$", output, re.M):
        assert result == str(sum(json.loads(args).values())), output


def test_the_guide_covers_every_client_the_issue_names():
    names = {name for name, _, _ in SNIPPETS}
    assert names == {"openai (Python)", "openai (Node)", "OpenAI Responses API (Python)", "OpenAI Responses API (Node)",
                     "Anthropic SDK", "LangChain", "LiteLLM", "instructor", "pydantic-ai", "OpenAI Agents SDK",
                     "MCP tools", "llama-index", "azure-ai-inference"}


@pytest.mark.parametrize(("name", "lang", "code"), SNIPPETS, ids=[s[0] for s in SNIPPETS])
def test_snippet_runs_against_the_server(base_url, mcp_tools_server: McpHttpServer, tmp_path, name, lang, code):
    code = code.replace("http://localhost:8000", base_url).replace(GUIDE_MCP_ORIGIN, mcp_tools_server.origin)
    env = {**os.environ, "NO_COLOR": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    if lang == "js":
        node = shutil.which("node")
        assert node and (NODE_DIR / "node_modules" / "openai").is_dir(), "scripts/install.sh installs Node's openai"
        script = NODE_DIR / f"snippet-{os.getpid()}.mjs"  # beside node_modules, where `import "openai"` resolves
        script.write_text(code)
        command = [node, str(script)]
    else:
        script = tmp_path / "snippet.py"
        script.write_text(code)
        command = [sys.executable, str(script)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    finally:
        if lang == "js":
            script.unlink(missing_ok=True)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), f"{name} printed nothing"
    if name in EXPECT:
        assert re.search(EXPECT[name], "\n" + done.stdout), f"{name} printed:\n{done.stdout}"
    if name == "MCP tools":
        ran_add(done.stdout)
