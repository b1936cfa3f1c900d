"""The scheduler alone, on a fake block oracle (ints only): token budget, sequence limit, first come first
served, decodes before prefills, preemption of the newest request, no admission in a preempting step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvdiet.engine.request import Request
from kvdiet.engine.sampling import SamplingParams
from kvdiet.engine.scheduler import Scheduler, SchedulerConfig
from kvdiet.setting_error import SettingError

BS = 4


class FakeCache:
    """A pool of ``free`` blocks; a request's session is its token count and block count."""

    block_size = BS

    def __init__(self, free: int) -> None:
        self.free = free
        self.preempted: list[str] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free

    def admission_blocks(self, r: Request) -> int:
        return -(-(len(r.all_ids) + r.decodes_after_prefill) // BS)

    def begin(self, r: Request) -> None:
        r.session = SimpleNamespace(state=SimpleNamespace(num_tokens=0, table=[]))
        r.prefill_target = len(r.all_ids)

    def blocks_needed(self, r: Request, n: int) -> int:
        s = r.session.state
        return max(0, -(-(s.num_tokens + n) // BS) - len(s.table))

    def preempt(self, r: Request) -> None:
        self.free += len(r.session.state.table)
        r.session = None
        self.preempted.append(r.request_id)

    def run(self, step) -> None:
        """Apply a plan: allocate the blocks and advance the token counts."""
        for r, n in [*step.prefills, *((r, 1) for r in step.decodes)]:
            need = self.blocks_needed(r, n)
            assert need <= self.free
            self.free -= need
            r.session.state.table += [0] * need
            r.session.state.num_tokens += n
            if r.session.state.num_tokens >= r.prefill_target and r in step.decodes:
                r.prefill_target += 1  # a decode feeds one more token


def _req(name: str, n: int) -> Request:
    return Request(name, list(range(1, n + 1)), SamplingParams(), 0.0, torch.Generator())


def test_budget_limit_and_first_come_first_served() -> None:
    cache = FakeCache(free=100)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=10), cache)
    for name, n in (("a", 7), ("b", 6), ("c", 3)):
        s.add(_req(name, n))
    step = s.schedule()
    assert [(r.request_id, n) for r, n in step.prefills] == [("a", 7), ("b", 3)] and step.num_tokens == 10
    assert [r.request_id for r in s.waiting] == ["c"]  # the sequence limit holds c back
    cache.run(step)
    step = s.schedule()
    assert [r.request_id for r in step.decodes] == ["a"] and [
        (r.request_id, n) for r, n in step.prefills
    ] == [("b", 3)]


def test_the_newest_request_is_preempted_and_nobody_is_admitted_that_step() -> None:
    cache = FakeCache(free=5)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), cache)
    a, b = _req("a", 8), _req("b", 7)
    s.add(a)
    cache.run(s.schedule())  # a: 8 tokens in 2 blocks
    s.add(b)
    cache.run(s.schedule())  # a decodes into a 3rd block, b prefills 7 tokens into 2: the pool is full
    assert cache.free == 0 and [r.request_id for r in s.running] == ["a", "b"]
    s.add(_req("c", 1))
    for _ in range(4):
        step = s.schedule()
        if step.preempted:
            break
        assert not step.prefills  # c never fits a full pool
        cache.run(step)
    assert cache.preempted == ["b"] and step.preempted == [b] and b.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # b first again; nobody admitted this step
    assert [r.request_id for r in step.decodes] == ["a"] and not step.prefills


def test_an_older_request_preempts_newer_ones_until_it_fits() -> None:
    cache = FakeCache(free=6)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), cache)
    reqs = [_req(n, 8) for n in "abc"]
    for r in reqs:
        s.add(r)
    cache.run(s.schedule())  # admits a and b (3 blocks each with the decode token); c waits
    assert [r.request_id for r in s.running] == ["a", "b"] and cache.free == 2
    cache.free = 0  # the pool fills up elsewhere
    step = s.schedule()  # a's decode needs a block: b (newest) goes
    assert cache.preempted == ["b"] and [r.request_id for r in step.decodes] == ["a"]


def test_config_errors_name_the_keyword_in_python_and_the_flag_on_the_command_line() -> None:
    with pytest.raises(SettingError) as info:
        SchedulerConfig(max_num_seqs=0)
    assert str(info.value) == "max_num_seqs must be >= 1, got 0"
    assert info.value.as_flags() == "--max-num-seqs must be >= 1, got 0"
    with pytest.raises(SettingError) as info:
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4)
    assert str(info.value).startswith("max_num_batched_tokens (4) must be >= max_num_seqs (16) so that")
    assert info.value.as_flags().startswith("--max-num-batched-tokens (4) must be >= --max-num-seqs (16) so")


class DroppedHitCache(FakeCache):
    """Admission counts 2 shared blocks that the restore plan then drops (a cold plan)."""

    def admission_blocks(self, r: Request) -> int:
        return super().admission_blocks(r) - 2


def test_an_admitted_request_whose_hit_is_dropped_gets_a_chunk_that_fits() -> None:
    cache = DroppedHitCache(free=3)  # admission thinks 5 - 2 = 3 blocks suffice for 16 + 1 tokens
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), cache)
    s.add(_req("a", 16))
    step = s.schedule()
    assert [(r.request_id, n) for r, n in step.prefills] == [("a", 12)]  # 3 blocks, not the 4 it wanted
    cache.run(step)
    assert cache.free == 0


def test_an_admitted_request_that_cannot_start_goes_back_to_the_head() -> None:
    cache = DroppedHitCache(free=0)  # admission thinks 2 - 2 = 0 blocks are needed
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), cache)
    s.add(_req("a", 4))
    s.add(_req("b", 4))
    step = s.schedule()
    assert step.empty and [r.request_id for r in s.waiting] == ["a", "b"] and not s.running
    assert cache.preempted == ["a"] and s.num_preemptions == 0


def test_partial_prefill_chunks_end_on_a_block_boundary() -> None:
    cache = FakeCache(free=100)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=10), cache)
    s.add(_req("a", 30))
    sizes = []
    for _ in range(4):
        step = s.schedule()
        sizes.append(step.prefills[0][1])
        cache.run(step)
    assert sizes == [8, 8, 8, 6]  # 10 tokens cut back to 8 (two blocks of 4); the rest of the prompt last
