"""CPU threads for torch: how many (``--threads``) and how idle ones wait.

torch runs its CPU ops on an OpenMP pool of ``torch.get_num_threads()`` threads, by default one per core of
the machine. Two things go wrong when another process shares those cores:

- GNU OpenMP (what torch's Linux wheels link) lets a thread that finished its share of an op spin for
  300,000 iterations before it sleeps. When another process holds a core, the spinning threads keep theirs
  while the straggler waits for a scheduler quantum, op after op. Measured here (v4.1-mini, a 512-token cold
  prefill, 2 cores, two busy processes beside it; `benchmarks/bench_contention.py`, best of 2): OpenMP's
  default 2.8 s idle, 24.5 s loaded (8.8×; 73× in another run); ``OMP_WAIT_POLICY=PASSIVE`` (never spin)
  4.6 s idle, 4.3 s loaded — robust, but every op then pays a wake-up, so idle work is 1.7× slower;
  ``GOMP_SPINCOUNT=50000`` (spin briefly, then sleep) 2.2 s idle, 5.3 s loaded (2.4×): idle speed kept,
  contention bounded. `bound_spinning` sets that unless the environment chooses (``OMP_WAIT_POLICY`` or
  ``GOMP_SPINCOUNT`` set, even empty, is kept). libgomp reads it once, when torch loads it, so it must run
  before the first ``import torch``; the ``kvdiet`` command does it first thing.
- A pool sized to the machine oversubscribes a process confined to fewer cores (``taskset``, a container's
  cpuset): `available_cores` counts the cores this process may run on, the default of ``--threads``.

Source for the spin counts: the libgomp manual, "GOMP_SPINCOUNT" (gcc.gnu.org/onlinedocs/libgomp).
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = [
    "SPIN_COUNT",
    "add_threads_arg",
    "available_cores",
    "bound_spinning",
    "check_threads",
    "max_threads",
    "set_threads",
]


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports one, else the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


SPIN_COUNT = "50000"
"""Iterations an idle OpenMP thread spins before it sleeps (libgomp's default: 300,000)."""


def bound_spinning() -> bool:
    """Set ``GOMP_SPINCOUNT`` to `SPIN_COUNT` unless the environment sets a wait policy or a spin count;
    whether it can still take effect (torch not imported yet)."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return "torch" not in sys.modules


def max_threads() -> int:
    """The most threads ``--threads`` takes: 4 per core of the machine (beyond that OpenMP fails to create
    them or crashes, and nothing is gained)."""
    return 4 * (os.cpu_count() or 1)


def check_threads(threads: int | None) -> None:
    """Raises ValueError unless ``threads`` is None or in ``[1, max_threads()]`` (one line naming the flag)."""
    if threads is not None and not 1 <= threads <= max_threads():
        raise ValueError(f"--threads must be between 1 and {max_threads()} (4 per core), got {threads}")


def set_threads(threads: int | None) -> int:
    """Size torch's CPU pool: ``threads``, or `available_cores` when None; returns the size.

    Raises:
        ValueError: ``threads`` outside ``[1, max_threads()]``.
    """
    check_threads(threads)
    import torch

    n = threads if threads is not None else available_cores()
    torch.set_num_threads(n)
    return n


def add_threads_arg(parser: argparse.ArgumentParser, *, note: str = "") -> None:
    """``--threads N``: torch's CPU threads (default: the cores this process may use); ``note`` ends its help
    (where the command uses it, e.g. replay's engine mode only)."""
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help=f"CPU threads for the model (default: the cores this process may use, {available_cores()} here"
        f"{'; ' + note if note else ''})",
    )
