"""Continuous batching: which requests run in the next step, with how many tokens each.

Every step has a token budget (``max_num_batched_tokens``). The scheduler spends it in this order:
1. running requests, oldest first: one token for each decoding request, a prefill chunk (up to the rest
   of the budget) for each request still prefilling — so chunked prefill is interleaved with the batched
   decode of the others;
2. waiting requests (new, or preempted; first come, first served) while fewer than ``max_num_seqs`` run,
   budget is left and the device pool can hold the request's whole prefill plus one decode token (none
   when the token it samples next is its last: that token is never fed back).

Since admission only spends budget that every running prefill left over, a request still prefilling is
always newer than every decoding one: the running list is decodes first, so decodes are never starved by
a long prefill (which, in turn, holds newer requests back until its last chunk).

Blocks: before a running request is scheduled, the blocks its tokens need this step are reserved; when
the pool cannot supply them, the most recently admitted running request is preempted (its blocks go back
to the pool, published ones stay findable by their hash) and re-queued at the front, until they fit. A
step that preempts admits nobody. Since every request fits the pool alone (the engine checks that
``max_model_len`` fits at start-up), the oldest request always progresses: no deadlock, no starvation.

The scheduler deals only in requests, token counts and block counts; the cache system answers through
`BlockOracle` (the engine implements it on `ModelRunner`). It knows nothing of tensors.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field
from numbers import Integral
from typing import Protocol

from kvdiet.engine.request import Request, RequestStatus
from kvdiet.setting_error import SettingError

__all__ = ["BlockOracle", "ScheduledStep", "Scheduler", "SchedulerConfig"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching limits (vLLM's flag names).

    Attributes:
        max_num_seqs: requests running at once (holding device blocks).
        max_num_batched_tokens: tokens processed per step, prefill and decode together (≥ max_num_seqs, so
            every running request can decode in every step).
    Raises:
        SettingError (a ValueError): a limit below 1, or a token budget below ``max_num_seqs``; named as
            keywords (the command line's flags in `SettingError.as_flags`).
        TypeError: a limit not an int (`numbers.Integral`: numpy's ints too, kept as Python's int; bools
            refused).
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise TypeError(f"{name} must be an int, got {value!r}")
            object.__setattr__(self, name, operator.index(value))  # numpy's ints too, kept as int
        if self.max_num_seqs < 1:
            raise SettingError(f"{{max_num_seqs}} must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SettingError(
                f"{{max_num_batched_tokens}} ({self.max_num_batched_tokens}) must be >= {{max_num_seqs}} "
                f"({self.max_num_seqs}) so that every running request can decode each step"
            )


class BlockOracle(Protocol):
    """What the scheduler asks the cache system (block counts only)."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, including cached-but-unreferenced ones)."""
        ...

    def admission_blocks(self, request: Request) -> int:
        """Free blocks a waiting request would consume to prefill its whole target and decode one token (if
        `Request.decodes_after_prefill`), counting prefix blocks other requests hold as shared (an estimate:
        a restore plan may drop the hit, and the scheduler re-checks after `begin`)."""
        ...

    def begin(self, request: Request) -> None:
        """Start the request's cache session (prefix lookup, load, restore or replay plan)."""
        ...

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """New blocks a running request needs to process ``num_tokens`` more tokens."""
        ...

    def preempt(self, request: Request) -> None:
        """End the request's cache session, keeping what can be reused (blocks back to the pool)."""
        ...


@dataclass(slots=True)
class ScheduledStep:
    """The plan of one step.

    Attributes:
        prefills: (request, tokens) — a prefill chunk of that many tokens for each.
        decodes: requests that feed their pending token (one token each, one batched forward).
        preempted: requests sent back to the waiting queue in this step.
        num_tokens: tokens scheduled in all (≤ ``max_num_batched_tokens``).
    """

    prefills: list[tuple[Request, int]] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Waiting and running queues and the per-step plan (see the module docstring).

    Args:
        config: batching limits.
        cache: the block oracle.
    """

    def __init__(self, config: SchedulerConfig, cache: BlockOracle) -> None:
        self.config, self.cache = config, cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of either queue (it must be in one; its session is the caller's business)."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        """Plan the next step; preempts and admits as described in the module docstring."""
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        reserved = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget) if req.is_prefilling else 1
            need = self.cache.blocks_needed(req, n)
            while need > self.cache.num_free_blocks - reserved and self.running[-1] is not req:
                self._preempt(self.running.pop(), step)
            if need > self.cache.num_free_blocks - reserved:  # req is the newest: it yields
                self._preempt(self.running.pop(), step)
                break
            reserved += need
            budget -= n
            if req.is_prefilling:
                step.prefills.append((req, n))
            else:
                step.decodes.append(req)
            i += 1
        while (
            self.waiting
            and not step.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and self.cache.admission_blocks(self.waiting[0]) <= self.cache.num_free_blocks - reserved
        ):
            req = self.waiting.popleft()
            self.cache.begin(req)
            n = self._chunk(req, budget)
            avail = self.cache.num_free_blocks - reserved
            if self.cache.blocks_needed(req, n) > avail:  # the restore plan dropped a shared hit
                n = self._fit(req, n, avail)
            if n == 0:  # it does not fit after all: back to the head of the queue, stop admitting
                self.cache.preempt(req)
                self.waiting.appendleft(req)
                break
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            reserved += self.cache.blocks_needed(req, n)
            budget -= n
            step.prefills.append((req, n))
        step.num_tokens = self.config.max_num_batched_tokens - budget
        return step

    def _chunk(self, req: Request, budget: int) -> int:
        """Prefill tokens for ``req`` this step: the rest of its prompt if the budget allows, else the budget
        cut back to a block boundary (when that leaves a token), so the window state at that boundary is
        captured and a preemption before the next chunk can resume exactly from it."""
        start = req.session.state.num_tokens
        rest = req.prefill_target - start
        if rest <= budget:
            return rest
        aligned = (start + budget) // self.cache.block_size * self.cache.block_size - start
        return aligned if aligned > 0 else budget

    def _fit(self, req: Request, n: int, avail: int) -> int:
        """The largest chunk below ``n`` whose new blocks fit in ``avail`` (0 if none)."""
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cache.blocks_needed(req, mid) <= avail:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _preempt(self, req: Request, step: ScheduledStep) -> None:
        self.cache.preempt(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req)
