#!/usr/bin/env bash
# Verify the vLLM engine on a machine with a CUDA GPU, and measure it:
#   1. .venv/ as `make install` makes it, plus the vllm extra (pip install -e '.[vllm]');
#   2. the vLLM tests: tests/gpu (a real model through VllmEngine and through HTTP with the openai client) and the
#      translation tests, with skips listed (-rs): a skip there means NOT verified;
#   3. `servelm serve` with one `engine = "vllm"` deployment, then `servelm bench` at 1, 16 and 64 concurrent
#      streams (fixed-length answers: ignore_eos), printing tokens/s, TTFT and ITL per level.
#
#   scripts/vllm_check.sh [MODEL]
# MODEL: a Hugging Face repo id (needs the network or the HF cache) or a local model directory; default
# $SERVELM_VLLM_TEST_MODEL, else Qwen/Qwen2.5-0.5B-Instruct. Results go to $OUT (default harness/results/).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="${1:-${SERVELM_VLLM_TEST_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}}"
PORT="${PORT:-8011}"
OUT="${OUT:-harness/results}"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"

bash scripts/install.sh
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[vllm]"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
.venv/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

echo "== tests (model: $MODEL)"
tests_rc=0
SERVELM_VLLM_TEST_MODEL="$MODEL" .venv/bin/python -m pytest -q -rs \
  tests/gpu tests/engine/test_vllm_mapping.py tests/engine/test_vllm_fake.py 2>&1 | tee "$OUT/gpu-tests-$STAMP.txt" \
  || tests_rc=$?

echo "== load (model: $MODEL)"
config="$(mktemp --suffix .toml)"
log="$OUT/gpu-server-$STAMP.log"
cat > "$config" <<EOF
[[deployments]]
name = "gpu"
model = "$MODEL"
engine = "vllm"
[deployments.vllm]
gpu_memory_utilization = 0.85
max_model_len = 4096
EOF
.venv/bin/servelm serve --config "$config" --port "$PORT" > "$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$config"' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$server" 2>/dev/null || { echo "the server exited; its log:"; tail -50 "$log"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "no /health after 600 s"; tail -50 "$log"; exit 1; }
.venv/bin/servelm bench --url "http://127.0.0.1:$PORT" --model gpu --max-concurrency 1,16,64 --num-prompts 128 \
  --random-input-len 256 --random-output-len 128 --ignore-eos --disable-tqdm --result-dir "$OUT/gpu-bench-$STAMP"
echo "results: $OUT/gpu-tests-$STAMP.txt $OUT/gpu-bench-$STAMP/ (server log: $log)"
exit "$tests_rc"  # the load figures are printed either way; a test failure still fails the check
