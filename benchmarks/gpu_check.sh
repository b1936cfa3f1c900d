#!/usr/bin/env bash
# The GPU check of issue 16, one run, < 10 minutes on one H200: the device-parametrised model tests and the
# Triton kernel test on CUDA (their cuda cases must run, not skip), `kvdiet golden` on CUDA, bench_decode and
# bench_prefill with --device cuda, and the packed-FP4 decode attention at 1M context against HBM bandwidth.
# Writes gpu_check.md (one table) and gpu_check.json (every step's JSON) under $OUT (default: a temp folder);
# exits non-zero, naming the step, when anything does not run.
#
# Needs a python with torch (CUDA build), triton and kvdiet's dependencies (PYTHON, default python3); the
# checkout is put on PYTHONPATH. DEVICE=cpu is the dry run on a machine without a GPU: the same steps at small
# sizes, Triton in its interpreter, the cuda test cases not required.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/gpu_check.log"
JSONL="$OUT/steps.jsonl"
: >"$LOG"
: >"$JSONL"

fail() { echo "gpu_check: FAILED: $*" | tee -a "$LOG" >&2; exit 1; }

# step NAME LIMIT_S CMD...: runs CMD under a time limit; its last stdout line (a JSON object) joins steps.jsonl
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$LOG"
  local start=$SECONDS out
  if ! out=$(timeout "$limit" "$@" 2>>"$LOG"); then
    echo "$out" >>"$LOG"
    fail "$name (exit status above, log $LOG)"
  fi
  echo "$out" >>"$LOG"
  local last
  last=$(printf '%s\n' "$out" | tail -n 1)
  printf '{"step": "%s", "seconds": %d, "result": %s}\n' "$name" $((SECONDS - start)) \
    "$(printf '%s' "$last" | "$PYTHON" -c 'import json,sys; t=sys.stdin.read(); print(t if t.startswith("{") else json.dumps(t))')" >>"$JSONL"
}

if [ "$DEVICE" = cpu ]; then
  export TRITON_INTERPRET=1
  CONTEXTS=4Ki TRITON_CONTEXT=4Ki TOKENS=64 BATCHES=1,2 CASES=cpu SKIPS_OK=1
else
  "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || fail "torch sees no CUDA device (python: $PYTHON)"
  CONTEXTS=4Ki,128Ki,1Mi TRITON_CONTEXT=1Mi TOKENS=256,1024,2048 BATCHES=1,4,16 CASES=cuda SKIPS_OK=0
fi
"$PYTHON" -c 'import triton, kvdiet' || fail "triton or kvdiet does not import (python: $PYTHON)"

# the device's cases (the CLI's no-CUDA message is the CPU-only machines' case); on CUDA a skip fails the check
step tests 300 bash -c "$PYTHON -m pytest tests/test_model_device.py tests/test_model_triton_decode.py -q \
  -p no:cacheprovider -rs -k '$CASES and not bad_device' | tee /dev/stderr | tail -n 1 | $PYTHON -c 'import json,sys
t = sys.stdin.read().strip(); print(json.dumps(t))
sys.exit(1 if (\"skipped\" in t and not $SKIPS_OK) or \"passed\" not in t or \"failed\" in t else 0)'"

GOLDEN=../shared/golden/tiny-fp8
if [ -d "$GOLDEN" ]; then
  step golden 120 "$PYTHON" -m kvdiet.cli golden "$GOLDEN" --device "$DEVICE" --json --check
else
  echo "== golden: $GOLDEN not here, step left out" | tee -a "$LOG"
fi

step bench_decode 180 "$PYTHON" benchmarks/bench_decode.py --device "$DEVICE" --contexts "$CONTEXTS" --steps 3 \
  --prefill-tokens 512 --chunks 128,512 --json-only

PREFILL_CONFIG=../shared/golden/bench-40layer-tiny/config.json
[ -f "$PREFILL_CONFIG" ] || PREFILL_CONFIG=configs/v4.1-mini.json
step bench_prefill 150 "$PYTHON" benchmarks/bench_prefill.py --device "$DEVICE" --config "$PREFILL_CONFIG" \
  --tokens "$TOKENS" --repeats 2 --steps 4 --batches "$BATCHES" --batch-context 128

step triton_decode 90 "$PYTHON" benchmarks/bench_triton_decode.py --device "$DEVICE" --context "$TRITON_CONTEXT" \
  --json-only

"$PYTHON" - "$JSONL" "$OUT" "$DEVICE" <<'EOF'
import json, sys
from pathlib import Path

steps = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines()]
out, device = Path(sys.argv[2]), sys.argv[3]
rows = ["| step | seconds | figure |", "|---|---|---|"]
for s in steps:
    r = s["result"]
    if s["step"] == "tests":
        fig = r
    elif s["step"] == "golden":
        fig = f"accepted {r['accepted']}, rows within tol {r['rows_within_tol']}/{r['rows']}"
    elif s["step"] == "bench_decode":
        fig = "; ".join(f"{d['context']:,} tokens {d['step_seconds'] * 1e3:.1f} ms ({d['step_seconds'] / d['floor_seconds']:.1f}× floor)" for d in r["decode"])
    elif s["step"] == "bench_prefill":
        fig = "; ".join(f"{k}: {v}" for k, v in r.items() if k not in ("bench", "seed", "config", "device", "threads"))[:400]
    else:
        fig = "; ".join(f"{c['case']} {c['gb_per_s']:,.0f} GB/s = {c['of_hbm']:.0%} of HBM, {c['of_copy']:.0%} of copy" for c in r["cases"])
    rows.append(f"| {s['step']} | {s['seconds']} | {fig} |")
table = f"GPU check on {device}\n\n" + "\n".join(rows) + "\n"
(out / "gpu_check.md").write_text(table)
(out / "gpu_check.json").write_text(json.dumps({"device": device, "steps": steps}, indent=1))
print(table)
EOF
echo "gpu_check: ok; table and JSON in $OUT"
