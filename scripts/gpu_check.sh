#!/usr/bin/env bash
# The accelerator check: one script that measures Rollbook on a GPU and writes JSON to OUT.
#
#   bash scripts/gpu_check.sh --wheels          here, with pip and a network: the wheels the GPU image
#                                               lacks (duckdb, pydantic, awex, ...) into .whl/ (about 28 MiB)
#   bash scripts/gpu_check.sh OUT               on the GPU machine: install from .whl/, then measure
#   bash scripts/gpu_check.sh OUT --device cpu  the same steps on the CPU with a tiny model (a dry run)
#
# The GPU image has torch, pyarrow, grpcio, protobuf, transformers and tokenizers but no network;
# what it lacks travels as wheels in .whl/ (Python 3.12, manylinux x86-64) and Rollbook itself is
# installed from this checkout. Steps, each bounded in time, and all together by GPU_CHECK_BUDGET_S
# (default 465 s on the GPU, so the whole stays within 8 minutes): a step gets at most what is left of
# it, and one that would get less than 20 s is skipped (rc null in summary.json):
#
#   env.json            torch, CUDA, the GPU's name and memory
#   logprob.log         the sampler/trainer log-prob agreement tests, float32 and bfloat16, on the CPU and
#                       (where torch sees one) on CUDA
#   trainer.json        bench/trainer.py: one decoupled-PPO + MOPD step of a ~0.5B Qwen2-style model
#                       (built from a config in code, nothing downloaded) in bfloat16 against a bare
#                       forward + backward of the same tokens
#   packed_memory.json  bench/packed_memory.py: peak memory of a packed 16,384-token micro-batch of a
#                       151,936-token vocabulary, the dense-mask, whole-batch-logits path against the
#                       chunked one
#   generate.json       bench/generate.py: the native engine against Hugging Face `generate` on the same
#                       model, a static batch of 64 and continuous arrivals
#   weights_test.log    the CUDA IPC channel's gpu test (tests/unit/test_weights_cuda_ipc.py -m gpu)
#   weights.json        bench/weights.py: the 0.5B model's bfloat16 weights (988 MB) from the trainer's
#                       GPU into a receiver process's model on the same GPU: shared memory (through
#                       host memory) against the CUDA IPC channel (device to device) and awex's
#                       colocated-mode IPC path, with a device memcpy and a host memcpy as the limits
#   run.json            `rollbook run --config configs/quickstart.toml --device DEVICE --dtype bfloat16`,
#                       100 steps: held-out reward per domain before and after, wall time; run-metrics.jsonl
#                       and run-report.md beside it
#   placement.json      bench/placement.py on the smoke config with `--device DEVICE --dtype bfloat16`:
#                       colocated, colocated-offload and separated (no ray: the image has no Ray), a few
#                       steps each and a kill-and-restart of each; trained tokens/s, peak RSS per role,
#                       peak device memory per train step (perf/peak_device_mib), weight-sync time,
#                       restart recovery; placement.png (when matplotlib is there) and placement.log
#                       (the tables) beside it
#
# A step that fails is recorded (its exit status in summary.json) and the next one runs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

WHEELS=(duckdb==2.0.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
        awex==0.9.0)  # awex: bench/weights.py's awex case only (pure Python, about 300 kB)

if [ "${1:-}" = "--wheels" ]; then
  mkdir -p .whl
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
fi
if [ $# -lt 1 ] || [ "${1:0:1}" = "-" ]; then
  echo "usage: bash scripts/gpu_check.sh OUT [--device cuda|cpu]   (or --wheels, here, first)" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then DEVICE=${2:?--device needs a value}; shift 2; fi
export PYTHONUNBUFFERED=1

PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! $PY -c "import duckdb, pydantic" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rollbook-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/rollbook-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $PY -c "import rollbook.trainer" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/rollbook-pkg . || exit 1
  export PYTHONPATH=/tmp/rollbook-pkg${PYTHONPATH:+:$PYTHONPATH}
fi

if [ "$DEVICE" = "cpu" ]; then  # a dry run: the same steps, small enough for a laptop
  TRAINER=(--model tiny --num-sequences 8 --max-tokens 512 --prompt-len 16 --output-len 112 --repeats 1)
  MEMORY=(--tokens 2048 --vocab 4096)
  RUN_STEPS=10
  GENERATE=(--model tiny --num-requests 64 --repeats 1)
  WEIGHTS=(--model tiny --repeats 3)
  PLACEMENT=(--steps 2 --samples 16 --warm-steps 5 --kill-after 1 --steps-after-kill 2 --kill-delay 0 --timeout 120)
  PLACEMENT_RUN=(--rollout.group_size 4 --rollout.num_prompts 2 --rollout.num_eval_tasks 4 --rollout.num_eval_samples 1
                 --trainer.model.hidden_size 64 --trainer.model.intermediate_size 128)
else
  TRAINER=(--model qwen2-0.5b --num-sequences 64 --max-tokens 16384 --prompt-len 64 --output-len 448 --repeats 3)
  MEMORY=(--tokens 16384 --vocab 151936)
  RUN_STEPS=100
  GENERATE=(--model qwen2-0.5b --num-threads 4)
  WEIGHTS=(--model qwen2-0.5b --repeats 5)
  PLACEMENT=(--steps 4 --samples 32 --warm-steps 20 --kill-after 1 --steps-after-kill 2 --timeout 60)
  PLACEMENT_RUN=(--rollout.num_eval_tasks 32)
fi
WEIGHT_CASES=memcpy,shared_memory,memcpy_device,shared_memory_loaded,cuda_ipc_loaded,awex_ipc_loaded
BUDGET_S=${GPU_CHECK_BUDGET_S:-$([ "$DEVICE" = cpu ] && echo 3600 || echo 465)}  # the CPU dry run is slower, not bounded

declare -A STATUS
step() {  # step NAME TIMEOUT_S COMMAND...: run it, record its exit status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 20 ]; then
    STATUS[$name]="{\"rc\": null, \"seconds\": 0, \"skipped\": \"${left}s of GPU_CHECK_BUDGET_S=${BUDGET_S} left\"}"
    echo "== $name: ${STATUS[$name]}" >&2
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at most ${limit}s): $*" >&2
  timeout "$limit" "$@"
  STATUS[$name]="{\"rc\": $?, \"seconds\": $((SECONDS - t0))}"
  echo "== $name: ${STATUS[$name]}" >&2
}

step env 60 $PY - "$DEVICE" >"$OUT/env.json" <<'EOF'
import json, sys, torch, transformers
device = sys.argv[1]
info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if device.startswith("cuda") and torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported())
print(json.dumps(info))
EOF
# the gpu-marked cases run where torch sees CUDA; on the CPU they are skipped
step logprob 120 $PY -m pytest -q -p no:cacheprovider -rs tests/integration/test_logprob_consistency.py \
  >"$OUT/logprob.log" 2>&1
step trainer 150 $PY bench/trainer.py --json --device "$DEVICE" --dtype bfloat16 "${TRAINER[@]}" >"$OUT/trainer.json"
step packed_memory 150 $PY bench/packed_memory.py --json --device "$DEVICE" --dtype bfloat16 "${MEMORY[@]}" >"$OUT/packed_memory.json"
step generate 120 $PY bench/generate.py --json --device "$DEVICE" --dtype bfloat16 "${GENERATE[@]}" >"$OUT/generate.json"
# the CUDA IPC channel's gpu-marked test: another process loads the trainer's device buffer bit for bit
step weights_test 60 $PY -m pytest -q -p no:cacheprovider -rs -m gpu tests/unit/test_weights_cuda_ipc.py >"$OUT/weights_test.log" 2>&1
step weights 90 $PY bench/weights.py --json --device "$DEVICE" --dtype bfloat16 --cases "$WEIGHT_CASES" "${WEIGHTS[@]}" \
  >"$OUT/weights.json"

RUN_DIR=$(mktemp -d)/run
step run 240 $PY -m rollbook.cli run --config configs/quickstart.toml --run_dir "$RUN_DIR" --device "$DEVICE" \
  --dtype bfloat16 --num_steps "$RUN_STEPS" --eval_every $((RUN_STEPS / 2)) >"$OUT/run.log" 2>&1
cp "$RUN_DIR/metrics.jsonl" "$OUT/run-metrics.jsonl" 2>/dev/null
cp "$RUN_DIR/report.md" "$OUT/run-report.md" 2>/dev/null
$PY - "$RUN_DIR" "$DEVICE" "${STATUS[run]}" >"$OUT/run.json" <<'EOF'
import json, pathlib, sys
run_dir, device, status = pathlib.Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval/sampled_reward" in r] \
    if (run_dir / "metrics.jsonl").is_file() else []
out = {"check": "rollbook run quickstart", "device": device, "dtype": "bfloat16", **status, "evaluations": len(evals)}
if evals:
    first, last = evals[0], evals[-1]
    out["steps"] = last["step"] + 1
    for key in sorted(k for k in first if k.startswith("eval/")):
        out[key] = [round(first[key], 4), round(last[key], 4)]
    out["sampled_gain"] = round(last["eval/sampled_reward"] - first["eval/sampled_reward"], 4)
print(json.dumps(out))
EOF

# last: it gets what is left of the budget; cut short (SIGTERM), it still reports the placements it measured
step placement 150 $PY bench/placement.py --json --png "$OUT/placement.png" --placements colocated,colocated-offload,separated \
  --no-online --work-dir "$(mktemp -d)" "${PLACEMENT[@]}" -- --device "$DEVICE" --dtype bfloat16 "${PLACEMENT_RUN[@]}" \
  >"$OUT/placement.json" 2>"$OUT/placement.log"

{
  printf '{"device": "%s"' "$DEVICE"
  for name in "${!STATUS[@]}"; do printf ', "%s": %s' "$name" "${STATUS[$name]}"; done
  printf '}\n'
} >"$OUT/summary.json"
cat "$OUT/summary.json"
