#!/usr/bin/env bash
# The GPU check of issue 16, one run, < 10 minutes on one H200: the device-parametrised model tests and the
# Triton kernel test on CUDA (their cuda cases must run, not skip), `kvdiet golden` on CUDA, bench_decode and
# bench_prefill with --device cuda, and the packed-FP4 decode attention at 1M context against HBM bandwidth.
# Writes gpu_check.md (one table) and gpu_check.json (every step's JSON) under $OUT (default: a temp folder).
# A step that fails or runs past its time limit is named in the table and the log, and the next step still
# runs (a lease is short: one run should say everything); the exit status is non-zero if any step failed.
#
# Needs a python with torch (CUDA build), triton and kvdiet's dependencies (PYTHON, default python3); the
# checkout is put on PYTHONPATH. DEVICE=cpu is the dry run on a machine without a GPU: the same steps at small
# sizes, Triton in its interpreter, the cuda test cases not required.
set -euo pipefail
USAGE="usage: [DEVICE=cuda|cpu] [OUT=DIR] [PYTHON=python3] bash benchmarks/gpu_check.sh [-h|--help]"
case "$#:${1-}" in
  1:-h | 1:--help)  # the usage line, then the comment block that opens this file: what it runs, writes and needs
    printf '%s\n\n' "$USAGE"
    sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
    exit 0
    ;;
  0:) ;;
  *) printf '%s\ngpu_check: error: unrecognized arguments: %s\n' "$USAGE" "$*" >&2; exit 2 ;;
esac
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
FAILED=()

# step NAME LIMIT_S CMD...: runs CMD under a time limit; its last stdout line (a JSON object) joins steps.jsonl,
# or, when CMD fails, the exit status does (and NAME joins FAILED)
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$LOG"
  local start=$SECONDS out status=0
  out=$(timeout -k 10 "$limit" "$@" 2>>"$LOG") || status=$?
  echo "$out" >>"$LOG"
  local last
  last=$(printf '%s\n' "$out" | tail -n 1)
  if [ "$status" -ne 0 ]; then
    FAILED+=("$name")
    echo "gpu_check: step $name FAILED (exit status $status$([ "$status" -eq 124 ] && echo ": past ${limit} s"))" \
      | tee -a "$LOG" >&2
    # the command's own JSON, if it printed one (golden --check prints its report, then fails), is kept
    if [ "${last:0:1}" = "{" ]; then
      last=$(printf '{"failed": "exit status %d", "result": %s}' "$status" "$last")
    else
      last=$(printf '{"failed": "exit status %d"}' "$status")
    fi
  fi
  printf '{"step": "%s", "seconds": %d, "result": %s}\n' "$name" $((SECONDS - start)) \
    "$(printf '%s' "$last" | "$PYTHON" -c 'import json,sys; t=sys.stdin.read(); print(t if t.startswith("{") else json.dumps(t))')" >>"$JSONL"
}

if [ "$DEVICE" = cpu ]; then
  export TRITON_INTERPRET=1
  CONTEXTS=4Ki TRITON_ARGS="--context 2Ki --batch 2 --splits 4 --repeats 1 --tiles fp16x3:16:16:4,ieee:16:16:4"
  TOKENS=64 BATCHES=1,2 CASES="(cpu or interpreter)" SKIPS_OK=1
else
  "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || fail "torch sees no CUDA device (python: $PYTHON)"
  CONTEXTS=4Ki,128Ki,1Mi TRITON_ARGS="--context 1Mi" TOKENS=256,1024,2048 BATCHES=1,4,16 CASES=cuda SKIPS_OK=0
  # the CPU's compiled kernels (kvdiet.formats.native) are not what this checks, and their first build would
  # cost the lease a minute: the CPU side of the comparisons runs the pure-torch path, bit-identical to them
  export KVDIET_NATIVE_KERNELS=${KVDIET_NATIVE_KERNELS:-0}
fi
"$PYTHON" -c 'import triton, kvdiet' || fail "triton or kvdiet does not import (python: $PYTHON)"

# the packed-FP4 decode attention first: the figure a short lease is for
# shellcheck disable=SC2086
step triton_decode 150 "$PYTHON" benchmarks/bench_triton_decode.py --device "$DEVICE" $TRITON_ARGS --json-only

# the device's cases (the CLI's no-CUDA message is the CPU-only machines' case); on CUDA a skip fails the check
step tests 200 bash -c "$PYTHON -m pytest tests/test_model_device.py tests/test_model_triton_decode.py -o addopts= -q \
  -p no:cacheprovider -rs -k '$CASES and not bad_device' | tee -a /dev/stderr | tail -n 1 | $PYTHON -c 'import sys
t = sys.stdin.read().strip(); print(t)
sys.exit(1 if (\"skipped\" in t and not $SKIPS_OK) or \"passed\" not in t or \"failed\" in t or \"error\" in t else 0)'"

GOLDEN=${GOLDEN:-../shared/golden/tiny-fp8}
if [ -d "$GOLDEN" ]; then
  step golden 90 "$PYTHON" -m kvdiet.cli golden "$GOLDEN" --device "$DEVICE" --json --check
else
  echo "== golden: $GOLDEN not here, step left out" | tee -a "$LOG"
fi

step bench_decode 180 "$PYTHON" benchmarks/bench_decode.py --device "$DEVICE" --contexts "$CONTEXTS" --steps 3 \
  --prefill-tokens 512 --chunks 128,512 --json-only

PREFILL_CONFIG=${PREFILL_CONFIG:-../shared/golden/bench-40layer-tiny/config.json}
[ -f "$PREFILL_CONFIG" ] || PREFILL_CONFIG=configs/v4.1-mini.json
step bench_prefill 150 "$PYTHON" benchmarks/bench_prefill.py --device "$DEVICE" --config "$PREFILL_CONFIG" \
  --tokens "$TOKENS" --repeats 2 --steps 4 --batches "$BATCHES" --batch-context 128

"$PYTHON" - "$JSONL" "$OUT" "$DEVICE" <<'EOF'
import json, sys
from pathlib import Path

steps = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines()]
out, device = Path(sys.argv[2]), sys.argv[3]
rows = ["| step | seconds | figure |", "|---|---|---|"]
def figure(step, r):
    if step == "tests":
        return r
    if step == "golden":
        return f"accepted {r['accepted']}, rows within tol {r['rows_within_tol']}/{r['rows']}"
    if step == "bench_decode":
        return "; ".join(f"{d['context']:,} tokens {d['step_seconds'] * 1e3:.1f} ms ({d['step_seconds'] / d['floor_seconds']:.1f}× floor)" for d in r["decode"])
    if step == "bench_prefill":
        return "; ".join(f"{k}: {v}" for k, v in r.items() if k not in ("bench", "seed", "config", "device", "threads"))[:400]
    return f"copy {r['copy_gb_per_s']:,.0f} GB/s, fp16 matmul {r['fp16_matmul_tflop_per_s']:,.0f} TFLOP/s; best: " + "; ".join(
        f"{case} {b['tile']} {b['gb_per_s']:,.0f} GB/s = {b['of_hbm']:.0%} of HBM" for case, b in r["best"].items())


for s in steps:
    r = s["result"]
    failed = isinstance(r, dict) and "failed" in r
    if failed:
        r = r.get("result")
    try:
        fig = figure(s["step"], r) if r is not None else ""
    except (KeyError, TypeError, ValueError):
        fig = f"unreadable result: {str(r)[:200]}"
    if failed:
        fig = f"FAILED: {s['result']['failed']} (log: gpu_check.log) {fig}".rstrip()
    rows.append(f"| {s['step']} | {s['seconds']} | {fig} |")
table = f"GPU check on {device}\n\n" + "\n".join(rows) + "\n"
(out / "gpu_check.md").write_text(table)
(out / "gpu_check.json").write_text(json.dumps({"device": device, "steps": steps}, indent=1))
print(table)
EOF
if [ ${#FAILED[@]} -gt 0 ]; then
  fail "${FAILED[*]} (table, JSON and log in $OUT)"
fi
echo "gpu_check: ok; table and JSON in $OUT"
