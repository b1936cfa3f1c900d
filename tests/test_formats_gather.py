"""The decode step's compiled gather of selected FP4 main-KV entries (``fp4.gather_main_kv``, ``gather_kernels.cpp``)
against its pure-torch twin (`BatchTables.gather` with ``KVDIET_NATIVE_KERNELS=0``: slots, index_select, decode)
and against its definition, bit for bit, in bf16 (its default: the same values exactly) and in fp32: every code
under the scale bytes at both ends of the range, repeated and block-edge entries, counts of 0, partial, full and
past K, strided pool rows, 1 and 2 threads, the AVX2 and scalar builds (`check_gather`, run by
test_formats_native's build test: slow); the input it declines (the torch path then raises or defers the error);
a bad stored scale byte deferred as the torch path does.
"""

from __future__ import annotations

import pytest
import torch

from kvdiet.formats import fp4, native
from kvdiet.formats.codec import CacheCodecs
from kvdiet.formats.scales import E4M3_SCALE_BYTES, run_checks
from kvdiet.model.batch_tables import BatchTables
from kvdiet.model.paged_pool import DevicePool

DIM, PER_BLOCK, BLOCKS = 512, 16, 24
WIDTH = DIM // 2 + DIM // 16
CODEC = CacheCodecs.for_dims(DIM, 128).main


def _rows(gen: torch.Generator, n: int) -> torch.Tensor:
    """uint8 [n, 288] entries: random value bytes (every code, signed zeros), scale bytes in the written range,
    both ends of it in every row."""
    rows = torch.randint(256, (n, WIDTH), dtype=torch.uint8, generator=gen)
    lo, hi = E4M3_SCALE_BYTES
    rows[:, DIM // 2 :] = torch.randint(lo, hi + 1, (n, DIM // 16), dtype=torch.uint8, generator=gen)
    rows[:, DIM // 2] = lo
    rows[:, DIM // 2 + 1] = hi
    rows[0, : DIM // 2] = torch.arange(256, dtype=torch.uint8)  # every pair of codes
    return rows


def _inputs(batch: int, k: int, seed: int = 0):
    """A pool of random entries, each request's table (a permutation of the pool's blocks, padded with block 0 as
    `BatchTables.of` pads), entry ids with repeats and block edges."""
    gen = torch.Generator().manual_seed(seed)
    rows = _rows(gen, BLOCKS * PER_BLOCK)
    table = torch.stack([torch.randperm(BLOCKS, generator=gen) for _ in range(batch)])
    table[-1, BLOCKS // 2 :] = 0  # the last request holds half the blocks
    held = [BLOCKS * PER_BLOCK] * (batch - 1) + [BLOCKS // 2 * PER_BLOCK]
    idx = torch.stack([torch.randint(h, (k,), generator=gen) for h in held])
    idx[:, 0], idx[:, 1] = 0, idx[:, 0]  # a repeat
    idx[:, 2] = PER_BLOCK - 1  # a block's last entry
    idx[:, 3] = torch.tensor(held) - 1  # the last entry held
    return rows, table, idx


def _definition(
    rows: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """The gather by its formula, one entry at a time, decoded on the pure-torch path."""
    out = torch.zeros(*idx.shape, DIM)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.ENV, "0")
        for b in range(idx.shape[0]):
            for j in range(min(counts[b], idx.shape[1])):
                e = int(idx[b, j])
                out[b, j] = fp4.decode_main_kv(
                    rows[int(table[b, e // PER_BLOCK]) * PER_BLOCK + e % PER_BLOCK]
                )
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The fp32 bits of ``t``'s values (bf16 widened exactly)."""
    return t.float().view(torch.int32)


def _tables(rows: torch.Tensor, table: torch.Tensor) -> BatchTables:
    """`BatchTables` of requests sharing one pool holding ``rows`` as layer 0's main KV."""
    pool = DevicePool({0: 64 // PER_BLOCK}, CacheCodecs.for_dims(DIM, 128), num_blocks=BLOCKS)
    pool.rows(0, "main").copy_(rows)
    return BatchTables([pool] * table.shape[0], table, pool)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("batch", "k", "counts"),
    [
        (1, 40, [40]),
        (1, 40, [7]),
        (3, 24, [24, 24, 24]),
        (3, 24, [24, 0, 9]),
        (2, 16, [30, 16]),
        (2, 8, [0, 0]),
    ],
)
def test_gather_equals_its_definition_and_the_torch_path(both, threads, batch, k, counts) -> None:
    rows, table, idx = _inputs(batch, k)
    tables = _tables(rows, table)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pool_rows = tables.shared.rows(0, "main")
        fused = fp4.gather_main_kv(pool_rows, table, idx, counts, PER_BLOCK)
        wide = fp4.gather_main_kv(pool_rows, table, idx, counts, PER_BLOCK, dtype=torch.float32)
        compiled, pure = both(lambda: tables.gather(0, idx, counts, CODEC, []))
    finally:
        torch.set_num_threads(before)
    want = _definition(rows, table, idx, counts)
    if any(counts):
        assert fused is not None and wide is not None
        assert fused.dtype == torch.bfloat16 and wide.dtype == torch.float32
        assert torch.equal(_bits(fused), want.view(torch.int32)) and torch.equal(_bits(wide), _bits(want))
        assert compiled.dtype == torch.bfloat16  # the step's gather takes the compiled call's bf16
    for got in (compiled, pure):
        assert got.shape == (batch, k, DIM) and torch.equal(_bits(got), want.view(torch.int32))
    assert bool(want[0].abs().max() > 0) == bool(counts[0])  # not a zero result passing for a gather


def check_gather() -> None:
    """The compiled gather against its definition at B = 1 and 3, full and partial counts (every code read); run in
    the AVX2 and scalar builds too (``test_formats_native.test_fp8_decode_and_window_read_of_other_isa_builds``)."""
    for batch, k, counts in ((1, 40, [40]), (3, 24, [24, 0, 9])):
        rows, table, idx = _inputs(batch, k)
        want = _bits(_definition(rows, table, idx, counts))
        for dtype in (torch.bfloat16, torch.float32):
            got = fp4.gather_main_kv(rows, table, idx, counts, PER_BLOCK, dtype=dtype)
            assert got is not None and got.dtype == dtype and torch.equal(_bits(got), want)


def test_gather_reads_strided_pool_rows() -> None:
    rows, table, idx = _inputs(2, 12, seed=1)
    wide = torch.zeros(rows.shape[0], WIDTH + 40, dtype=torch.uint8)
    wide[:, 5 : 5 + WIDTH] = rows
    view = wide[:, 5 : 5 + WIDTH]
    got = fp4.gather_main_kv(view, table, idx, [12, 5], PER_BLOCK)
    assert got is not None and not view.is_contiguous()
    assert torch.equal(_bits(got), _bits(_definition(rows, table, idx, [12, 5])))


def test_gather_writes_into_a_buffer_of_its_dtype_only() -> None:
    """``out`` of the call's shape, dtype and layout is written (every element) and returned; another is not used;
    a dtype other than bf16 and fp32 is refused."""
    rows, table, idx = _inputs(2, 12, seed=4)
    want = _bits(_definition(rows, table, idx, [12, 5]))
    for dtype in (torch.bfloat16, torch.float32):
        buf = torch.full((2, 12, DIM), float("nan"), dtype=dtype)  # every element must be written
        got = fp4.gather_main_kv(rows, table, idx, [12, 5], PER_BLOCK, buf, dtype=dtype)
        assert got is buf and torch.equal(_bits(got), want)
        other = torch.zeros(2, 12, DIM, dtype=torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)
        got = fp4.gather_main_kv(rows, table, idx, [12, 5], PER_BLOCK, other, dtype=dtype)
        assert got is not other and got.dtype == dtype and torch.equal(_bits(got), want)
        assert not bool(other.any())
    with pytest.raises(ValueError, match=r"bfloat16 or float32, not torch\.float16"):
        fp4.gather_main_kv(rows, table, idx, [12, 5], PER_BLOCK, dtype=torch.float16)


def test_gather_declines_what_the_kernel_does_not_take() -> None:
    rows, table, idx = _inputs(2, 12, seed=2)
    assert fp4.gather_main_kv(rows, table, idx, [12, 12], PER_BLOCK) is not None
    wrong = idx.clone()
    wrong[1, 3] = BLOCKS * PER_BLOCK  # its block lies past the table
    assert fp4.gather_main_kv(rows, table, wrong, [12, 12], PER_BLOCK) is None
    assert fp4.gather_main_kv(rows, table, wrong, [12, 3], PER_BLOCK) is not None  # not read: past its count
    wrong[1, 3] = -1
    assert fp4.gather_main_kv(rows, table, wrong, [12, 12], PER_BLOCK) is None
    last = idx.clone()
    last[0, 4] = int((table[0] == BLOCKS - 1).nonzero()) * PER_BLOCK  # an entry of the pool's last block
    assert fp4.gather_main_kv(rows, table, last, [12, 12], PER_BLOCK) is not None
    short = rows[:-PER_BLOCK]  # that entry's row lies past these
    assert fp4.gather_main_kv(short, table, last, [12, 12], PER_BLOCK) is None
    assert fp4.gather_main_kv(rows, table, idx.int(), [12, 12], PER_BLOCK) is None
    assert fp4.gather_main_kv(rows, table, idx.t().contiguous().t(), [12, 12], PER_BLOCK) is None
    assert fp4.gather_main_kv(rows, table.int(), idx, [12, 12], PER_BLOCK) is None
    assert fp4.gather_main_kv(rows, table, idx, [12], PER_BLOCK) is None
    assert fp4.gather_main_kv(rows[:, :-1], table, idx, [12, 12], PER_BLOCK) is None
    assert fp4.gather_main_kv(rows.t().contiguous().t(), table, idx, [12, 12], PER_BLOCK) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.ENV, "0")
        assert fp4.gather_main_kv(rows, table, idx, [12, 12], PER_BLOCK) is None


@pytest.mark.parametrize("env", [None, "0"], ids=["compiled", "pure"])
def test_a_bad_scale_byte_is_deferred_as_the_torch_path_does(monkeypatch, env) -> None:
    if env:
        monkeypatch.setenv(native.ENV, env)
    rows, table, idx = _inputs(2, 12, seed=3)
    e = int(idx[1, 5])
    bad = int(table[1, e // PER_BLOCK]) * PER_BLOCK + e % PER_BLOCK
    rows[bad, DIM // 2 + 4] = 0x7F  # E4M3 NaN: outside the written range
    tables = _tables(rows, table)
    if env is None:
        assert fp4.gather_main_kv(tables.shared.rows(0, "main"), table, idx, [12, 12], PER_BLOCK) is None
    pending: list = []
    got = tables.gather(0, idx, [12, 12], CODEC, pending)
    assert bool(got.isfinite().all())  # the byte reads clamped until the check is run
    with pytest.raises(ValueError, match=r"^fp4_e2m1_e4m3x16: stored scale byte 127 is outside"):
        run_checks(pending)
    clean: list = []
    tables.gather(0, idx, [12, 5], CODEC, clean)  # the bad entry is past request 1's count: not read
    run_checks(clean)
