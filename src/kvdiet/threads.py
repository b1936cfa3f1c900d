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
  (its run-queue wait, ``/proc/thread-self/schedstat``, over a tenth of the time since the last check) and
  doubles it back, up to the default, once that wait is gone; the engine asks it before every forward
  (`adapt_threads`). kvdiet's compiled kernels give the same bits at any thread count (their tests run 1 and 2
  threads), and so did whole prefills and decode steps on the presets tried (``tests/test_threads.py``).

Source for the spin counts: the libgomp manual, "GOMP_SPINCOUNT" (gcc.gnu.org/onlinedocs/libgomp). Source for
the run-queue wait: the kernel's Documentation/scheduler/sched-stats.rst (``/proc/<pid>/schedstat``: time on the
CPU, time waiting on a run queue, both in ns, and timeslices run).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable

__all__ = [
    "CHECK_INTERVAL_S",
    "CLEAR_SHARE",
    "CONTENDED_SHARE",
    "SPIN_COUNT",
    "AdaptiveThreads",
    "adapt_threads",
    "add_threads_arg",
    "available_cores",
    "bound_spinning",
    "check_threads",
    "max_threads",
    "run_queue_wait_ns",
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


def max_threads() -> int:
    """The most threads ``--threads`` takes: 4 per core of the machine (beyond that OpenMP fails to create
    them or crashes, and nothing is gained)."""
    return 4 * (os.cpu_count() or 1)


def check_threads(threads: int | None) -> None:
    """Raises ValueError unless ``threads`` is None or in ``[1, max_threads()]`` (one line naming the flag)."""
    if threads is not None and not 1 <= threads <= max_threads():
        raise ValueError(f"--threads must be between 1 and {max_threads()} (4 per core), got {threads}")


def set_threads(threads: int | None) -> int:
    """Size torch's CPU pool: ``threads``, or `available_cores` when None; returns the size. A pool sized by
    default then adapts to CPU contention (`AdaptiveThreads`, asked by `adapt_threads`); a given size is kept.

    Raises:
        ValueError: ``threads`` outside ``[1, max_threads()]``.
    """
    global _adaptive
    check_threads(threads)
    import torch

    n = threads if threads is not None else available_cores()
    torch.set_num_threads(n)
    _adaptive = AdaptiveThreads(n) if threads is None else None
    return n


CONTENDED_SHARE = 0.10
"""Run-queue wait, as a share of the time since the last check, above which the pool is halved."""
CLEAR_SHARE = 0.02
"""Run-queue wait share below which the pool is doubled back (up to its default size)."""
CHECK_INTERVAL_S = 0.1
"""Seconds between two looks at the run-queue wait (asked more often, `AdaptiveThreads.check` only returns)."""


def run_queue_wait_ns() -> int | None:
    """Nanoseconds the calling thread has waited on a run queue (runnable, no CPU free) since it started: the
    second field of ``/proc/thread-self/schedstat``; None where the system has no such file."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


class AdaptiveThreads:
    """torch's CPU pool sized to what the cores give: halved while the thread running the model waits for a CPU,
    doubled back once it no longer does (see the module's notes: a barrier's partner parked by the scheduler
    costs a whole slice).

    Each `check` (before a forward) that comes at least ``interval`` seconds after the last look reads the calling
    thread's run-queue wait (``read_wait``, ns, cumulative) and divides its growth by the seconds passed: above
    `CONTENDED_SHARE` the pool goes from n to max(1, n // 2) threads, below `CLEAR_SHARE` to min(``threads``,
    2n); between the two it stays. The first look is over the time since construction (the model's load).

    Args:
        threads: the pool's default size (>= 1), the most it grows back to.
        clock: seconds, monotonic. read_wait: the run-queue wait in ns, or None where unknown (never adapts).
        interval: seconds between looks.
        resize: sets the pool's size (torch.set_num_threads).
    """

    def __init__(
        self,
        threads: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        read_wait: Callable[[], int | None] = run_queue_wait_ns,
        interval: float = CHECK_INTERVAL_S,
        resize: Callable[[int], None] | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if resize is None:
            import torch

            resize = torch.set_num_threads
        self.threads = self.current = threads
        self.resizes = 0  # times the pool changed size
        self._clock, self._read_wait, self._interval, self._resize = clock, read_wait, interval, resize
        self._since, self._wait = clock(), read_wait()

    def check(self) -> int:
        """The pool's size for the next forward, after resizing it where the run-queue wait says so."""
        now = self._clock()
        if self._wait is None or now - self._since < self._interval:
            return self.current
        wait = self._read_wait()
        if wait is None:
            return self.current
        share = (wait - self._wait) / 1e9 / (now - self._since)
        self._since, self._wait = now, wait
        size = self.current
        if share > CONTENDED_SHARE:
            size = max(1, self.current // 2)
        elif share < CLEAR_SHARE:
            size = min(self.threads, 2 * self.current)
        if size != self.current:
            _log.debug("run-queue wait %.0f%% of the time: %d -> %d threads", 100 * share, self.current, size)
            self._resize(size)
            self.current, self.resizes = size, self.resizes + 1
        return self.current


_adaptive: AdaptiveThreads | None = None


def adapt_threads() -> int | None:
    """`AdaptiveThreads.check` of the pool `set_threads` sized by default (the engine calls it before each
    forward); None, and nothing done, where the pool's size was given or never set here."""
    return None if _adaptive is None else _adaptive.check()


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
