"""Cold prefill under another process's full CPU load, against the same prefill on an idle machine.

``kvdiet generate`` (v4.1-mini, random weights, a fixed prompt of ``--tokens`` ids, no persistent tier) runs
in a fresh process, first on an idle machine, then beside busy-looping processes, one per core this process
may use (another job taking every core). Four settings (`kvdiet.threads`): kvdiet's default (its pool sized to
the cores and halved while the model's thread waits for a CPU, `AdaptiveThreads`; ``GOMP_SPINCOUNT=50000``:
spin briefly, then sleep), the same spin with a fixed pool (``--threads`` the cores: what the default was
before the pool adapted), OpenMP's own default spin (what a plain ``import torch`` gets: 300,000 iterations;
run with an empty ``OMP_WAIT_POLICY``, which kvdiet keeps and libgomp ignores) and ``OMP_WAIT_POLICY=PASSIVE``
(never spin); ``--threads`` fixes every row's pool. Each figure is the best of ``--repeats`` runs. The goal
(issue: a fast engine): loaded ≤ 3× idle, idle as fast as OpenMP's default. Prints a table, then one JSON
line.

    python benchmarks/bench_contention.py                  # ~4 min on 2 cores
    python benchmarks/bench_contention.py --tokens 1024 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import subprocess
import sys

from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.threads import available_cores

SEED = 0
LIMIT_S = 300
"""A run that takes longer is stopped and reported as "> 300 s" (OpenMP's default under load can take
minutes)."""


def _busy() -> None:
    while True:
        pass


SETTINGS = {  # name → (environment beside the caller's, without its OpenMP variables; a fixed pool)
    "kvdiet default (adaptive pool)": ({}, False),
    "kvdiet spin, fixed pool": ({}, True),
    "OpenMP default spin": ({"OMP_WAIT_POLICY": ""}, False),
    "OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, False),
}


def prefill_seconds(tokens: int, setting: dict[str, str], threads: int | None) -> float:
    """``prefill_seconds`` of one cold ``kvdiet generate`` in a fresh process with ``setting``."""
    ids = ",".join(str((SEED + 7919 * i) % 50_000 + 1) for i in range(tokens))
    argv = ["generate", "--model", "v4.1-mini", "--prompt-ids", ids, "--max-tokens", "1"]
    argv += ["--persistent-dir", "none", "--seed", str(SEED), "--json"]
    if threads is not None:
        argv += ["--threads", str(threads)]
    code = "import sys; from kvdiet.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | setting
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, *argv],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        return math.inf  # reported as "> LIMIT_S"
    return float(json.loads(out.stdout)["prefill_seconds"])


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per figure, best kept (default 2)")
    parser.add_argument("--threads", type=int, help="kvdiet generate --threads (default: its own default)")
    args = parser.parse_args()
    cores = available_cores()
    rows = []
    for name, (setting, fixed) in SETTINGS.items():
        threads = args.threads if args.threads is not None or not fixed else cores
        idle = min(prefill_seconds(args.tokens, setting, threads) for _ in range(args.repeats))
        load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(cores)]
        for p in load:
            p.start()
        try:
            loaded = min(prefill_seconds(args.tokens, setting, threads) for _ in range(args.repeats))
        finally:
            for p in load:
                p.terminate()
                p.join()
        done = math.isfinite(loaded)
        rows.append(
            {
                "setting": name,
                "idle_s": idle,
                "loaded_s": loaded if done else None,
                "ratio": round(loaded / idle, 2) if done else None,
            }
        )

    table = Table(title=f"cold prefill of {args.tokens} tokens (v4.1-mini), idle vs {cores} busy processes")
    for col in ("setting", "idle s", "loaded s", "loaded / idle"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for r in rows:
        if r["loaded_s"] is None:
            table.add_row(
                r["setting"], f"{r['idle_s']:.2f}", f"> {LIMIT_S}", f"> {LIMIT_S / r['idle_s']:.0f}×"
            )
        else:
            table.add_row(r["setting"], f"{r['idle_s']:.2f}", f"{r['loaded_s']:.2f}", f"{r['ratio']:.2f}×")
    Console().print(table)
    print(
        json.dumps({"bench": "contention", "seed": SEED, "tokens": args.tokens, "cores": cores, "rows": rows})
    )


if __name__ == "__main__":
    main()
