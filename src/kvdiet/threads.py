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
- The spin bound alone is not enough on every kernel: on Linux 6.18 (EEVDF scheduler; an AMD EPYC VM, 2 cores)
  the same bench read 1.21 s idle and 41.2 s loaded (34×) with ``GOMP_SPINCOUNT=50000``, and 4.3-7.0 s in three
  more loaded runs: a thread that waits at a barrier for a partner the scheduler has parked still burns its
  slice. With one thread there is no partner to wait for: 2.7-2.8 s loaded (1.76 s idle at one thread). So when
  the pool is sized by default, `AdaptiveThreads` halves it while the thread running the model waits for a CPU
  (its run-queue wait, ``/proc/thread-self/schedstat``, over a tenth of its runnable time) and doubles it back,
  up to the default, once that wait is gone; the engine's runner asks it before every forward
  (`adaptive_threads` makes one for ``generate`` and ``serve``). 1 and 2 threads gave the same bits on the
  presets tested (``tests/test_threads.py``), but not on every shape everywhere: on the AMD EPYC (Zen 4), MKL's
  products of a few rows by a few columns ([2, 64]·[64, 4]: v4.1-micro's router of two rows) gave other bits at
  one thread than at two even in the strict mode below; v4.1-mini's and V4.1-Flash's products did not.
- Intel MKL (torch's BLAS on x86) may split a product's sums by the thread count: on an Intel Xeon VM (2 cores)
  the mHC coefficients' product of 16 or more rows ([T, 1024] · [1024, 24]: a prefill chunk, a batched decode
  step) gave other bits at 2 threads than at 1, so a pool that adapts would have changed results; on the AMD EPYC
  it did not. `reproducible_blas` asks MKL for its strict reproducible mode (``MKL_CBWR=AUTO,STRICT``). Intel
  documents that mode for ``?gemm``, ``?symm``, ``?hemm`` and ``?trsm`` on its AVX2 and AVX-512 code paths (other
  routines keep the plain mode); measured there, every product of the presets tested (batched ones too) gave the
  same bits at 1 and 2 threads (``tests/test_threads.py``). Intel asks for it before any other MKL call; here it
  took effect when set after ``import torch`` but before the first product, so importing ``kvdiet`` sets it. It
  holds for the whole process (another MKL user in it, an MKL numpy say, gets the mode too). Its cost there: a
  one-row product of that shape 3.8-4.1 → 7.9-8.8 µs (80 such a v4.1-mini decode step).

Source for the spin counts: the libgomp manual, "GOMP_SPINCOUNT" (gcc.gnu.org/onlinedocs/libgomp). Source for
``MKL_CBWR`` and strict mode: Intel's oneMKL developer guide, "Reproducibility Conditions". Source for
the run-queue wait: the kernel's Documentation/scheduler/sched-stats.rst (``/proc/<pid>/schedstat``: time on the
CPU, time waiting on a run queue, both in ns, and timeslices run).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = [
    "CHECK_INTERVAL_S",
    "CLEAR_SHARE",
    "CONTENDED_SHARE",
    "GROW_AFTER",
    "MIN_RUNNABLE_S",
    "MKL_CBWR",
    "SPIN_COUNT",
    "AdaptiveThreads",
    "adaptive_threads",
    "add_threads_arg",
    "available_cores",
    "bound_spinning",
    "check_threads",
    "max_threads",
    "reproducible_blas",
    "schedstat",
    "set_threads",
]

_log = logging.getLogger(__name__)


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


MKL_CBWR = "AUTO,STRICT"
"""Intel MKL's reproducibility mode kvdiet asks for: AUTO, the code path MKL picks for the CPU; STRICT, products
whose bits do not depend on the number of threads (module docstring)."""


def reproducible_blas() -> bool:
    """Set ``MKL_CBWR`` to `MKL_CBWR` unless the environment sets it (even empty: kept); whether it is `MKL_CBWR`
    now. MKL reads it once, before its first call: a process that ran an MKL product before this keeps MKL's
    default mode."""
    os.environ.setdefault("MKL_CBWR", MKL_CBWR)
    return os.environ["MKL_CBWR"] == MKL_CBWR


def max_threads() -> int:
    """The most threads ``--threads`` takes: 4 per core of the machine (beyond that OpenMP fails to create
    them or crashes, and nothing is gained)."""
    return 4 * (os.cpu_count() or 1)


def check_threads(threads: int | None) -> None:
    """Raises ValueError unless ``threads`` is None or in ``[1, max_threads()]`` (one line naming the flag)."""
    if threads is not None and not 1 <= threads <= max_threads():
        raise ValueError(f"--threads must be between 1 and {max_threads()} (4 per core), got {threads}")


def set_threads(threads: int | None) -> int:
    """Size torch's CPU pool: ``threads``, or `available_cores` when None; returns the size (a pool sized by
    default may then adapt to contention: `adaptive_threads`).

    Raises:
        ValueError: ``threads`` outside ``[1, max_threads()]``.
    """
    check_threads(threads)
    import torch

    n = threads if threads is not None else available_cores()
    torch.set_num_threads(n)
    return n


CONTENDED_SHARE = 0.10
"""Share of its runnable time the model's thread spent waiting for a CPU above which the pool is halved (tuned
on `benchmarks/bench_contention.py`: a 2-thread pool beside 2 busy processes waits 30-40% of it, alone ~0%)."""
CLEAR_SHARE = 0.02
"""Waiting share below which a look counts as clear; `GROW_AFTER` clear looks in a row double the pool back."""
GROW_AFTER = 10
"""Clear looks in a row (at least a second apart from first to last) before the pool doubles: with one core free,
one thread waits for nothing and two do, so a pool that grew at once would flip size every look."""
CHECK_INTERVAL_S = 0.1
"""Seconds between two looks at the wait (asked more often, `AdaptiveThreads.check` only returns)."""
MIN_RUNNABLE_S = 0.02
"""Seconds the thread must have run or waited to run since the last decision before the next (time asleep, e.g.
an idle server's, counts for nothing)."""


def schedstat() -> tuple[int, int] | None:
    """``(ns on a CPU, ns waiting on a run queue)`` of the calling thread since it started: the first two fields
    of ``/proc/thread-self/schedstat``; None where the system has no such file or keeps no such accounting (all
    zeros)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            run, wait = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return None if run == wait == 0 else (run, wait)


class AdaptiveThreads:
    """torch's CPU pool sized to what the cores give: halved while the thread running the model waits for a CPU,
    doubled back once it no longer does (the module's notes: a barrier's partner parked by the scheduler costs a
    whole slice). An engine's `kvdiet.engine.runner.ModelRunner` given one calls `check` before each prefill
    chunk and decode step: each decision is on the work before it, the forward runs at the size it gives.

    A `check` at least ``interval`` seconds after the last look reads the calling thread's `schedstat`; once
    that thread has run or waited `MIN_RUNNABLE_S` since the last decision, the share of that time spent
    waiting decides: above `CONTENDED_SHARE` the pool goes from n to max(1, n // 2) threads; below
    `CLEAR_SHARE` the look is clear, and `GROW_AFTER` clear looks in a row take it to min(``threads``, 2n);
    between the two nothing changes. The first look counts from construction (a command's model load) when the
    same thread asks; a look from another thread (a server's engine thread) starts afresh there.

    Bits: kvdiet's compiled kernels, and whole prefills and decode steps of the presets tested, give the same
    bits on 1 and 2 threads. On 3 or more, torch's own ops split their loops by the thread count, so a result's
    low bits follow the pool's size (as they follow the core count between machines: a v4.1-mini prefill of
    1,000 tokens and three decode steps moved its logits by up to 0.004 between 1 and 3 threads); ``--threads
    N`` fixes the pool where that matters.

    Args:
        threads: the pool's default size, the most it grows back to.
        clock: seconds, monotonic. read: `schedstat` of the calling thread, or None (never adapts).
        interval: seconds between looks. grow_after: clear looks in a row before the pool grows.
        resize: sets the pool's size (torch.set_num_threads).
    Raises:
        ValueError: ``threads`` or ``grow_after`` below 1, or ``interval`` not positive.
    """

    def __init__(
        self,
        threads: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], tuple[int, int] | None] = schedstat,
        interval: float = CHECK_INTERVAL_S,
        grow_after: int = GROW_AFTER,
        resize: Callable[[int], None] | None = None,
    ) -> None:
        if threads < 1 or grow_after < 1 or not interval > 0:
            raise ValueError(
                f"threads and grow_after must be >= 1 and interval > 0, got {threads}, {grow_after}, {interval}"
            )
        if resize is None:
            import torch

            resize = torch.set_num_threads
        self.threads = self.current = threads
        self.resizes = 0  # times the pool changed size
        self._clock, self._read, self._interval, self._grow_after = clock, read, interval, grow_after
        self._resize, self._clear = resize, 0
        self._since, self._thread, self._base = clock(), threading.get_native_id(), read()

    def check(self) -> int:
        """The pool's size for the next forward, after resizing it where the waiting share says so."""
        now = self._clock()
        if now - self._since < self._interval:
            return self.current
        self._since, thread, stats = now, threading.get_native_id(), self._read()
        if stats is None or self._base is None or thread != self._thread:
            self._thread, self._base, self._clear = thread, stats, 0  # no figures yet for this thread
            return self.current
        ran, waited = stats[0] - self._base[0], stats[1] - self._base[1]
        if ran < 0 or waited < 0:  # figures of another thread under a reused id
            self._base, self._clear = stats, 0
            return self.current
        if ran + waited < MIN_RUNNABLE_S * 1e9:
            return self.current  # mostly asleep since the last decision: wait for more
        self._base, share, size = stats, waited / (ran + waited), self.current
        if share > CONTENDED_SHARE:
            self._clear, size = 0, max(1, self.current // 2)
        elif share < CLEAR_SHARE:
            self._clear += 1
            if self._clear >= self._grow_after:
                self._clear, size = 0, min(self.threads, 2 * self.current)
        else:
            self._clear = 0
        if size != self.current:
            _log.debug(
                "waited %.0f%% of its runnable time: %d -> %d threads", 100 * share, self.current, size
            )
            self._resize(size)
            self.current, self.resizes = size, self.resizes + 1
        return self.current


def adaptive_threads(threads: int | None, device: str) -> AdaptiveThreads | None:
    """The adaptive pool for a command's ``--threads`` (after `set_threads`): one sized as torch's pool is now
    where the flag was left to its default and the model runs on the CPU, else None (a given size is kept; a
    GPU's work does not run on the pool)."""
    if threads is not None or device != "cpu":
        return None
    import torch

    return AdaptiveThreads(torch.get_num_threads())


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
