#!/usr/bin/env bash
# servelm on llama.cpp's CUDA backend, checked on a GPU machine that may have no network, in three steps:
#
#   scripts/gpu_check.sh bundle    # here, with a network, after `make install` and a commit: makes .gpu/ (git-ignored,
#                                  #   ~20 MB; GPU_BUILD_DIR=DIR carries DIR/bin, a CUDA build, instead of the source)
#   scripts/gpu_check.sh build     # there, with .gpu/ and the checkout: llama.cpp with CUDA, wheels, models (~6 min
#                                  #   on 16 cores; ~1 min when .gpu/cuda-build.tar.xz brings a build)
#   scripts/gpu_check.sh measure   # there, right after: the checks below (~2 min)
#   scripts/gpu_check.sh types     # there: servelm's self-check and the probe on each type alone (GPU_TYPES)
#
# build compiles the pinned llama-cpp-python's own llama.cpp, unchanged, with GGML_CUDA=ON for the GPU that
# nvidia-smi lists, as shared libraries that servelm loads (LLAMA_CPP_LIB_PATH), and llama-server,
# llama-batched-bench and llama-quantize from the same build. It installs the carried wheels and makes random-weight
# models of Llama-3.2-1B's shape (harness/random_model.py) in F16, Q8_0 and Q4_K_M. GPU_SAVE_BUILD=1 also packs the
# build into $OUT/cuda-build.tar.xz.* (parts under 16 MiB), which a later bundle can carry: cat them into
# .gpu/cuda-build.tar.xz.
# measure runs, on the Q4_K_M model unless GPU_MODEL names another:
#   - the kernel limit: llama-batched-bench, every layer on the GPU, 256-token prompts and 128-token answers;
#   - servelm (its start-up self-check, where each model runs) and llama-server (-np 64) from the same build; should
#     servelm not come up, harness/load_variants.py says which part of the load fails;
#   - harness/gpu_probe.py against both: answers alone, beside strangers, and among identical requests;
#   - servelm bench --compare at 1, 16 and 64 streams;
#   - servelm's self-check and the probe on the F16 and Q8_0 models.
# Results go to $OUT (default harness/results/gpu): gpu-summary.json, the logs, and the bench's JSON.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
G="$ROOT/.gpu"
W=${GPU_WORK:-/tmp/servelm-gpu}
OUT=${OUT:-$ROOT/harness/results/gpu}
step=${1:-}

bundle() {
  set -e
  mkdir -p "$G/whl" "$W/sdist"
  grep -qx '/.gpu/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$ROOT/.git/info/exclude"
  local v py src
  v=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml")
  py="$ROOT/.venv/bin/python"
  [ -f "$W/sdist/llama_cpp_python-$v.tar.gz" ] || "$py" -m pip download -q --no-deps --no-binary :all: -d "$W/sdist" \
    "llama-cpp-python==$v"
  rm -rf "$W/sdist/src" && mkdir -p "$W/sdist/src" && tar xzf "$W/sdist/llama_cpp_python-$v.tar.gz" -C "$W/sdist/src"
  src="$W/sdist/src/llama_cpp_python-$v"
  # llama.cpp as the sdist vendors it, without what the build does not read (76 MB -> about 10)
  tar czf "$G/llama-src.tar.gz" -C "$src/vendor" --exclude=llama.cpp/models --exclude=llama.cpp/docs \
    --exclude=llama.cpp/media --exclude=llama.cpp/benches --exclude=llama.cpp/tests --exclude=llama.cpp/gguf-py \
    --exclude=llama.cpp/conversion llama.cpp
  tar czf "$G/llama_cpp_py.tar.gz" -C "$src" llama_cpp  # its Python side; the C library is the build there
  # wheels for Python 3.12 (the GPU machine's) of what its image lacks; servelm's own source travels as the checkout
  local pins plats=""
  pins=$("$py" -m pip freeze | grep -iE '^(fastapi|starlette|uvicorn|httptools|pydantic|pydantic[-_]core|pydantic-settings|python-dotenv|annotated-types|typing-inspection|llguidance|gguf|confusable-homoglyphs|python-multipart|opentelemetry-api|opentelemetry-sdk|opentelemetry-semantic-conventions|importlib[-_]metadata|diskcache|prometheus[-_]client)==')
  for n in 5 17 24 27 28 31 34 35; do plats="$plats --platform manylinux_2_${n}_x86_64"; done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 $plats -d "$G/whl" $pins
  "$py" -m harness.random_model vocab "$G/vocab.gguf"
  git -C "$ROOT" archive --format=tar.gz -o "$G/servelm-src.tar.gz" HEAD servelm harness scripts pyproject.toml
  if [ -n "${GPU_BUILD_DIR:-}" ]; then  # a CUDA build made elsewhere (its bin/): carried instead of the source
    (cd "$GPU_BUILD_DIR" && tar cf - bin/*.so* bin/llama-server bin/llama-batched-bench bin/llama-quantize) \
      | xz -T0 -9 > "$G/cuda-build.tar.xz"
    rm -f "$G/llama-src.tar.gz"
  fi
  du -sh "$G"
}

env_there() {
  # servelm as committed when the bundle was made (the checkout there may hold work in progress), else the checkout
  local src="$ROOT"
  if [ -f "$G/servelm-src.tar.gz" ]; then
    src="$W/servelm-src"
    rm -rf "$src" && mkdir -p "$src" && tar xzf "$G/servelm-src.tar.gz" -C "$src" && cd "$src" || exit 1
  fi
  export PYTHONPATH="$src:$W/site" LLAMA_CPP_LIB_PATH="$W/build/bin" MTMD_CPP_LIB="$W/build/bin" PYTHONUNBUFFERED=1
  PY=${GPU_PYTHON:-python3}
  # a carried build finds CUDA's runtime and cuBLAS where the toolkit or its pip packages keep them
  local d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $("$PY" -c "import glob, site; print(' '.join(
      sorted({p.rsplit('/', 1)[0] for s in site.getsitepackages() for p in glob.glob(s + '/nvidia/*/lib/libcu*.so*')})))" \
      2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
  done
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
}

build() {
  mkdir -p "$W" "$OUT"
  exec > >(tee -a "$OUT/build.log") 2>&1
  env_there
  local t0 jobs arch
  t0=$(date +%s); jobs=$(nproc)
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader || true
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
  if [ ! -x "$W/build/bin/llama-server" ] && ls "$G"/cuda-build.tar.xz >/dev/null 2>&1; then
    mkdir -p "$W/build" && tar xJf "$G/cuda-build.tar.xz" -C "$W/build" || exit 1
    echo "build: carried"
  fi
  if [ ! -x "$W/build/bin/llama-server" ]; then
    rm -rf "$W/src" && mkdir -p "$W/src" && tar xzf "$G/llama-src.tar.gz" -C "$W/src"
    cmake -S "$W/src/llama.cpp" -B "$W/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA="${GPU_CUDA:-ON}" \
      -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF $("$PY" "$ROOT/scripts/llama_cmake_args.py" | sed 's/-DGGML_CUDA=ON//; s/-DCMAKE_CUDA_ARCHITECTURES=[^ ]*//') \
      > "$W/cmake.log" 2>&1 || { tail -40 "$W/cmake.log"; exit 1; }
    timeout "${GPU_BUILD_S:-480}" cmake --build "$W/build" -j "$jobs" \
      --target llama mtmd llama-server llama-batched-bench llama-quantize > "$W/build.log" 2>&1 \
      || { grep -E "error" "$W/build.log" | head -20; tail -20 "$W/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - t0 )) s"
  fi
  if [ -n "${GPU_SAVE_BUILD:-}" ]; then
    (cd "$W/build" && tar cf - bin/*.so* bin/llama-server bin/llama-batched-bench bin/llama-quantize \
      | xz -T0 -6 | split -b 15M -d - "$OUT/cuda-build.tar.xz.") && ls -la "$OUT"/cuda-build.tar.xz.*
  fi
  [ -n "${GPU_SKIP_WHEELS:-}" ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$W/site" "$G"/whl/*.whl || exit 1
  mkdir -p "$W/site" && tar xzf "$G/llama_cpp_py.tar.gz" -C "$W/site"
  "$PY" -c "import servelm.runners.llamacpp as L; from llama_cpp import llama_cpp as C; \
print('GPU offload:', C.llama_supports_gpu_offload(), [d.name + ' ' + d.description for d in L.gpus()])" || exit 1
  local shape=${GPU_SHAPE:-1b} t1
  t1=$(date +%s)
  [ -f "$W/$shape-f16.gguf" ] || "$PY" -m harness.random_model model "$W/$shape-f16.gguf" "$G/vocab.gguf" --shape "$shape" || exit 1
  for q in ${GPU_QUANTS:-Q4_K_M Q8_0}; do
    local f="$W/$shape-$(echo $q | tr 'A-Z' 'a-z').gguf"
    [ -f "$f" ] || "$W/build/bin/llama-quantize" "$W/$shape-f16.gguf" "$f" "$q" "$jobs" > "$W/quantize.log" 2>&1 \
      || { tail -20 "$W/quantize.log"; exit 1; }
  done
  ls -la "$W"/*.gguf
  echo "models: $(( $(date +%s) - t1 )) s; build step: $(( $(date +%s) - t0 )) s"
}

pids=()
stop_servers() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; pids=(); }
wait_up() {  # URL SECONDS PID
  for _ in $(seq "$2"); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$3" 2>/dev/null || { echo "the server at $1 exited"; return 1; }
    sleep 1
  done; echo "no health at $1 after $2 s"; return 1
}

serve() {  # NAME MODEL PORT SEQS: servelm in the background, up or not
  "$PY" -X faulthandler -m servelm serve --model-path "$2" --model-id m --port "$3" --no-embedding-model \
    --max-num-seqs "$4" --context-window 1024 --max-step-tokens 2048 ${GPU_SERVELM_ARGS:-} > "$OUT/$1.log" 2>&1 &
  pids+=($!)
  wait_up "http://127.0.0.1:$3" 240 $! || { tail -60 "$OUT/$1.log"; return 1; }
  curl -s "http://127.0.0.1:$3/v1/models" > "$OUT/$1-models.json"
  "$PY" -c "import json,sys; c=json.load(open(sys.argv[1]))['data'][0]; print('servelm:', c.get('placement'), '|', c.get('exactness'))" "$OUT/$1-models.json"
}

diagnose() {  # MODEL: why servelm did not come up (a crash at load, as once seen): a native stack, and which import
  local dbg   #   made before llama.cpp's library makes a load fail
  dbg=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null | head -1)
  if [ -n "$dbg" ]; then
    timeout 90 "$dbg" -q -batch -ex "set pagination off" -ex run -ex "bt 40" --args "$PY" -m servelm serve \
      --model-path "$1" --model-id m --port 8009 --no-embedding-model --max-num-seqs 64 --context-window 1024 \
      --max-step-tokens 2048 2>&1 | grep -vE "^\[(New )?Thread|^\[Inferior" | tail -60 > "$OUT/native-stack.txt"
    tail -45 "$OUT/native-stack.txt"
  fi
  timeout 120 "$PY" -m harness.load_variants "$1" --imports --timeout 30 | tee "$OUT/load-variants.txt" | grep "=="
}

measure() {
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/measure.log") 2>&1
  env_there
  trap stop_servers EXIT
  local B="$W/build/bin" M=${GPU_MODEL:-$W/${GPU_SHAPE:-1b}-q4_k_m.gguf} NGL=${GPU_NGL:-99} t0 up=1 url
  t0=$(date +%s)
  echo "== kernel limit"
  timeout 150 "$B/llama-batched-bench" -m "$M" -ngl "$NGL" -fa on -c 49152 -b 2048 -ub 512 -npp 256 -ntg 128 \
    -npl 1,16,64 2>&1 | grep -E "^\|" | tee "$OUT/batched-bench.txt"
  echo "== servelm ($(( $(date +%s) - t0 )) s)"
  serve servelm "$M" 8001 64 || { up=""; stop_servers; diagnose "$M"; }
  echo "== llama-server ($(( $(date +%s) - t0 )) s)"
  "$B/llama-server" -m "$M" -ngl "$NGL" -fa on -np 64 -c 65536 --port 8002 --alias m --no-webui \
    > "$OUT/llama-server.log" 2>&1 &
  pids+=($!)
  wait_up http://127.0.0.1:8002 120 $! || tail -30 "$OUT/llama-server.log"
  echo "== exactness at the API ($(( $(date +%s) - t0 )) s)"
  [ -z "$up" ] || timeout 150 "$PY" -m harness.gpu_probe http://127.0.0.1:8001 m | tee "$OUT/probe-servelm.json"
  timeout 90 "$PY" -m harness.gpu_probe http://127.0.0.1:8002 m | tee "$OUT/probe-llama-server.json"
  echo "== bench ($(( $(date +%s) - t0 )) s)"
  if [ -n "$up" ]; then url="--url http://127.0.0.1:8001 --label servelm --compare http://127.0.0.1:8002"
  else url="--url http://127.0.0.1:8002 --label llama-server"; fi
  timeout "${GPU_BENCH_S:-200}" "$PY" -m servelm bench $url --model m --dataset-name random --random-input-len 256 \
    --random-output-len 128 --num-prompts "${GPU_PROMPTS:-64}" --max-concurrency 1,16,64 --ignore-eos --temperature 0 \
    --disable-tqdm --no-plot --result-dir "$OUT/bench" 2>&1 \
    | grep -E "^\| (output_throughput|median_tpot_ms|median_ttft_ms|p99_itl_ms) |^Footing|^- "
  [ -z "$up" ] || curl -s http://127.0.0.1:8001/metrics \
    | grep -E "^servelm_engine_(phase_seconds_total|steps_total|forward_calls_total)" > "$OUT/servelm-metrics.txt"
  stop_servers
  for q in ${GPU_MORE-f16 q8_0}; do
    local f="$W/${GPU_SHAPE:-1b}-$q.gguf"
    [ -f "$f" ] && [ -n "$up" ] || continue
    echo "== servelm on $q ($(( $(date +%s) - t0 )) s)"
    serve "servelm-$q" "$f" 8003 16 && timeout 90 "$PY" -m harness.gpu_probe http://127.0.0.1:8003 m --rounds 1 \
      | tee "$OUT/probe-servelm-$q.json"
    stop_servers
  done
  "$PY" -m harness.gpu_probe --summary "$OUT"
  if [ -n "${GPU_LATE:-}" ]; then  # does serve crash when llama.cpp's libraries load after servelm's other imports?
    echo "== serve with llama.cpp loaded last ($(( $(date +%s) - t0 )) s)"
    timeout 45 "$PY" -X faulthandler -c "import servelm.__main__ as m; m.main(['serve', '--model-path', '$M', \
'--model-id', 'm', '--port', '8004', '--no-embedding-model', '--max-num-seqs', '64', '--context-window', '1024', \
'--max-step-tokens', '2048'])" > "$OUT/late.log" 2>&1
    echo "exit $? (124: still serving when stopped)"
    grep -E "Fatal|Segmentation|startup complete|runs on" "$OUT/late.log" | head -5
  fi
  echo "measure: $(( $(date +%s) - t0 )) s"
}

types() {  # servelm's self-check and the probe on each model type in GPU_TYPES (default q4_k_m q8_0 f16)
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/types.log") 2>&1
  env_there
  trap stop_servers EXIT
  local q
  for q in ${GPU_TYPES:-q4_k_m q8_0 f16}; do
    echo "== servelm on $q"
    serve "servelm-$q" "$W/${GPU_SHAPE:-1b}-$q.gguf" 8003 16 \
      && timeout 60 "$PY" -m harness.gpu_probe http://127.0.0.1:8003 m --rounds 1 | tee "$OUT/probe-servelm-$q.json"
    stop_servers
  done
}

case "$step" in
  bundle) bundle ;;
  build) build ;;
  measure) measure ;;
  types) types ;;
  *) echo "usage: scripts/gpu_check.sh bundle|build|measure|types" >&2; exit 2 ;;
esac
