"""`EngineLoop`: the engine on its thread, driven from asyncio — concurrent streams, early exit aborts,
a failed step stops serving, close aborts what runs; typed commands; the immutable `EngineSnapshot`."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvdiet.engine.args import EngineArgs
from kvdiet.engine.engine_snapshot import EngineSnapshot
from kvdiet.engine.generate import generate
from kvdiet.engine.loop import EngineDeadError, EngineLoop
from kvdiet.engine.runner import CacheOptions
from kvdiet.engine.sampling import SamplingParams
from kvdiet.engine.scheduler import SchedulerConfig

ARGS = EngineArgs(
    model="v4.1-micro",
    cache=CacheOptions(block_size=4, kv_cache_memory=1 << 20),
    scheduler=SchedulerConfig(4, 16),
)


@pytest.fixture
def loop():
    loop = EngineLoop(ARGS.create_engine()).start()
    yield loop
    loop.close()


async def _collect(loop: EngineLoop, ids: list[int], params: SamplingParams) -> list:
    return [out async for out in loop.generate(loop.engine.prepare(ids, params))]


def _wait_idle(loop: EngineLoop, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while loop.engine.requests and time.monotonic() < end:
        time.sleep(0.01)


def test_concurrent_streams_equal_solo_runs(loop: EngineLoop) -> None:
    prompts = [[5, 6, 7, 8, 9, 10], list(range(1, 25)), [7, 7, 7]]
    params = SamplingParams(max_tokens=5)

    async def main() -> list[list]:
        return await asyncio.gather(*(_collect(loop, p, params) for p in prompts))

    streams = asyncio.run(main())
    for p, outs in zip(prompts, streams, strict=True):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        ids = [t for o in outs for t in o.new_token_ids]
        assert ids == list(outs[-1].output_ids) == generate(loop.engine.model, p, params).output_ids
    assert loop.engine.stats.generation_tokens == 15


def test_leaving_a_stream_early_aborts_the_request(loop: EngineLoop) -> None:
    free = loop.engine.runner.pool.blocks.num_free

    async def main() -> int:
        n = 0
        async for _ in loop.generate(loop.engine.prepare(list(range(1, 30)), SamplingParams(max_tokens=100))):
            n += 1
            if n == 2:
                break
        return n

    assert asyncio.run(main()) == 2
    _wait_idle(loop)
    assert not loop.engine.requests and loop.engine.runner.pool.blocks.num_free == free
    assert loop.engine.stats.finished["abort"] == 1


def test_rejected_request_raises_and_the_loop_keeps_serving(loop: EngineLoop) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="token id 64"):
            await _collect(loop, [1, 64], SamplingParams(max_tokens=2))
        outs = await _collect(loop, [1, 2], SamplingParams(max_tokens=2))
        assert outs[-1].finish_reason == "length"

    asyncio.run(main())
    assert loop.healthy


def test_a_failed_step_stops_serving(loop: EngineLoop) -> None:
    def broken() -> list:
        raise RuntimeError("boom")

    loop.engine.step = broken

    async def main() -> None:
        with pytest.raises(EngineDeadError, match="boom"):
            await _collect(loop, [1, 2, 3], SamplingParams(max_tokens=2))

    asyncio.run(main())
    assert not loop.healthy
    with pytest.raises(EngineDeadError):
        loop.submit(loop.engine.prepare([1, 2], SamplingParams()), lambda out: None, "late")


def test_close_aborts_running_requests() -> None:
    loop = EngineLoop(ARGS.create_engine()).start()
    got: list = []
    loop.submit(loop.engine.prepare(list(range(1, 30)), SamplingParams(max_tokens=200)), got.append, "r")
    time.sleep(0.3)
    loop.close()
    assert got and got[-1].finished and got[-1].finish_reason == "abort"
    assert not loop.healthy
    assert loop.engine.runner.pool.blocks.num_used == 0


def test_a_departed_caller_is_aborted_and_the_engine_keeps_serving(loop: EngineLoop) -> None:
    def closed_event_loop(_: object) -> None:
        raise RuntimeError("Event loop is closed")

    free = loop.engine.runner.pool.blocks.num_free
    loop.submit(
        loop.engine.prepare(list(range(1, 30)), SamplingParams(max_tokens=50)), closed_event_loop, "gone"
    )
    end = time.monotonic() + 30
    while loop.engine.stats.finished["abort"] == 0 and time.monotonic() < end:
        time.sleep(0.01)
    _wait_idle(loop)
    assert loop.healthy and loop.engine.stats.finished["abort"] == 1
    assert loop.engine.runner.pool.blocks.num_free == free

    async def main() -> list:
        return await _collect(loop, [1, 2, 3], SamplingParams(max_tokens=2))

    assert asyncio.run(main())[-1].finish_reason == "length"


def test_requests_queued_when_the_engine_fails_are_refused_not_forgotten() -> None:
    import threading

    loop = EngineLoop(ARGS.create_engine()).start()
    release = threading.Event()

    def failing_step() -> list:
        release.wait(10)
        raise RuntimeError("boom")

    loop.engine.step = failing_step
    got: dict[str, list] = {r: [] for r in "abc"}
    loop.submit(loop.engine.prepare([1, 2, 3], SamplingParams(max_tokens=2)), got["a"].append, "a")
    time.sleep(0.3)  # the loop is inside the failing step now
    loop.submit(loop.engine.prepare([4, 5], SamplingParams(max_tokens=2)), got["b"].append, "b")
    loop.submit(loop.engine.prepare([6, 7], SamplingParams(max_tokens=2)), got["c"].append, "c")
    release.set()
    end = time.monotonic() + 10
    while not all(got.values()) and time.monotonic() < end:
        time.sleep(0.01)
    assert all(len(v) == 1 and isinstance(v[0], EngineDeadError) for v in got.values()), got
    loop.close()


def test_a_duplicate_request_id_is_refused_and_the_loop_keeps_serving(loop: EngineLoop) -> None:
    """The one refusal left below the edge: the prepared request is queued, the id is taken."""
    first: list = []
    second: list = []
    params = SamplingParams(max_tokens=20)
    loop.submit(loop.engine.prepare(list(range(1, 30)), params), first.append, "dup")
    loop.submit(loop.engine.prepare([1, 2, 3], params), second.append, "dup")
    end = time.monotonic() + 30
    while not (first and first[-1].finished) and time.monotonic() < end:
        time.sleep(0.01)
    assert len(second) == 1 and isinstance(second[0], ValueError) and "already in use" in str(second[0])
    assert first[-1].finish_reason == "length" and len(first[-1].output_ids) == 20
    assert loop.healthy


def test_abort_all_ends_every_stream_with_abort(loop: EngineLoop) -> None:
    free = loop.engine.runner.pool.blocks.num_free
    got: dict[str, list] = {r: [] for r in "ab"}
    for rid, out in got.items():
        loop.submit(loop.engine.prepare(list(range(1, 30)), SamplingParams(max_tokens=200)), out.append, rid)
    time.sleep(0.2)
    loop.abort_all()
    end = time.monotonic() + 10
    while not all(v and v[-1].finished for v in got.values()) and time.monotonic() < end:
        time.sleep(0.01)
    assert all(v[-1].finish_reason == "abort" for v in got.values()), got
    _wait_idle(loop)
    assert loop.healthy and loop.engine.runner.pool.blocks.num_free == free


def _wait_snapshot(loop: EngineLoop, predicate, timeout: float = 10.0) -> EngineSnapshot:
    end = time.monotonic() + timeout
    while not predicate(loop.snapshot) and time.monotonic() < end:
        time.sleep(0.05)
    return loop.snapshot


def test_the_snapshot_is_an_immutable_copy_of_the_engine_figures(loop: EngineLoop) -> None:
    import dataclasses

    async def run(ids: list[int]) -> list:
        return await _collect(loop, ids, SamplingParams(max_tokens=3))

    asyncio.run(run(list(range(1, 30))))
    before = _wait_snapshot(loop, lambda s: s.generation_tokens == 3)
    assert isinstance(before, EngineSnapshot)
    blocks = loop.engine.runner.pool.blocks
    assert (before.num_running, before.num_waiting, before.num_used_blocks) == (0, 0, 0)
    assert before.num_blocks == blocks.num_blocks and before.kv_cache_usage == 0.0
    assert (
        before.prompt_tokens == 29
        and before.device.query_tokens == loop.engine.runner.stats.device.query_tokens
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.generation_tokens = 0
    queried = before.device.query_tokens
    asyncio.run(run(list(range(1, 30))))  # the same prompt again: a device-pool hit
    after = _wait_snapshot(loop, lambda s: s.generation_tokens == 6)
    assert after is not before and after.device.hit_tokens > 0 and after.device.query_tokens > queried
    assert before.device.query_tokens == queried and before.device.hit_tokens == 0  # the old one never moves


def test_a_caller_never_sees_its_finished_request_counted_as_running() -> None:
    """The snapshot a metrics scrape reads is taken again before a final output is handed over — finished
    by length, aborted mid-run, or aborted by `close` — so at the moment the caller gets it (read here inside
    the delivery itself, on the engine thread: no timing involved) the request is neither running nor
    waiting and its blocks are back; the snapshot from the step before still counted it."""
    loop = EngineLoop(ARGS.create_engine(), refresh_s=0.0).start()  # a full refresh after every step
    seen: dict[str, list] = {"length": [], "abort": [], "close": []}

    def deliver(rid: str):
        def record(out) -> None:
            s = loop.snapshot
            seen[rid].append((out.finished, s.num_running, s.num_waiting, s.num_used_blocks))

        return record

    def wait(done) -> None:
        end = time.monotonic() + 30
        while not done():
            assert time.monotonic() < end, seen
            time.sleep(0.01)

    ids = list(range(1, 30))
    loop.submit(loop.engine.prepare(ids, SamplingParams(max_tokens=3)), deliver("length"), "length")
    loop.submit(loop.engine.prepare(ids[:9], SamplingParams(max_tokens=200)), deliver("abort"), "abort")
    wait(lambda: seen["length"] and seen["length"][-1][0] and len(seen["abort"]) >= 2)
    loop.abort("abort")
    wait(lambda: seen["abort"][-1][0])
    loop.submit(loop.engine.prepare(ids[:5], SamplingParams(max_tokens=200)), deliver("close"), "close")
    wait(lambda: len(seen["close"]) >= 2)
    loop.close()
    for rid, outs in seen.items():
        assert [f for f, *_ in outs] == [False] * (len(outs) - 1) + [True], (rid, outs)
        assert outs[-2][1] >= 1, (rid, outs)  # counted as running when its previous output came out
    assert seen["length"][-1][1:3] == (1, 0)  # only "abort" runs on
    assert seen["abort"][-1][1:] == (0, 0, 0) and seen["close"][-1][1:] == (0, 0, 0)


def test_a_snapshot_can_keep_the_resident_figures_of_an_earlier_one(loop: EngineLoop) -> None:
    """`EngineSnapshot.take` with ``resident`` keeps that snapshot's tier-resident bytes and entries (a query
    of the tier each) and cached-block count (a pass over the pool's hashes) and reads everything else now."""
    import dataclasses

    asyncio.run(_collect(loop, list(range(1, 30)), SamplingParams(max_tokens=2)))
    _wait_idle(loop)
    fresh = EngineSnapshot.take(loop.engine)
    old = dataclasses.replace(
        fresh, num_running=7, generation_tokens=0, swa_pool_entries=12345, swa_pool_bytes=678,
        persistent_bytes=9, persistent_entries=10, num_cached_blocks=fresh.num_cached_blocks + 11,
    )  # fmt: skip
    kept = EngineSnapshot.take(loop.engine, resident=old)
    assert (kept.swa_pool_entries, kept.swa_pool_bytes, kept.persistent_bytes, kept.persistent_entries) == (
        12345, 678, 9, 10,
    )  # fmt: skip
    assert kept == dataclasses.replace(
        fresh, swa_pool_entries=12345, swa_pool_bytes=678, persistent_bytes=9, persistent_entries=10,
        num_cached_blocks=fresh.num_cached_blocks + 11,
    )  # fmt: skip
    assert fresh.generation_tokens == 2 and fresh.swa_pool_entries != 12345


def test_requests_count_as_waiting_from_the_moment_they_are_submitted() -> None:
    """While the engine thread is inside a long step, requests submitted meanwhile are not in the engine yet:
    the snapshot counts them as waiting at once (16 at once had shown as 2 running, 0 waiting for seconds), and
    still counts them during the next step, after they are taken in and before it ends."""
    import threading

    loop = EngineLoop(ARGS.create_engine(), refresh_s=3600.0).start()  # no timed refresh: only the events
    engine, gate, inside = loop.engine, threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        inside.set()
        assert gate.wait(10)
        return step()

    engine.step = held_step
    try:
        params = SamplingParams(max_tokens=2)
        rids = ["first", *(f"r{i}" for i in range(5))]
        loop.submit(engine.prepare([1, 2, 3], params), lambda out: None, rids[0])
        assert inside.wait(10)  # the first request's step has begun and waits
        for rid in rids[1:]:
            loop.submit(engine.prepare([4, 5, 6], params), lambda out: None, rid)
        s = loop.snapshot
        assert s.num_running + s.num_waiting == 6 and s.num_waiting >= 5
        inside.clear()
        gate.set()
        assert inside.wait(10)  # the next step: the five are in the engine now
        gate.clear()
        s = loop.snapshot
        assert s.num_running + s.num_waiting == 6
        gate.set()
    finally:
        gate.set()
        loop.close()
