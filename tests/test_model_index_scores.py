"""Indexer scores on stored keys (`kvdiet.model.index_scores`): compiled kernel and pure-torch path bit for bit,
packed and decoded keys alike, paged rows, gathered scores equal to dense ones, and the selection over them; the
integer path's AMX products against its vector dots and pure torch."""

from __future__ import annotations

import pytest
import torch

from kvdiet.formats import mxfp4, native
from kvdiet.model.index_scores import (
    StoredKeys,
    _native,
    index_scores,
    index_scores_at,
    index_scores_each,
    index_scores_runs,
)
from kvdiet.model.selection import block_max, candidate_entries, select_topk, select_topk_at

NEG = float("-inf")


def _case(seed: int, q: int, h: int, d: int, n: int):
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(q, h, d, generator=gen)
    w = torch.randn(q, h, generator=gen)
    packed = mxfp4.encode_index_key(torch.randn(n, d, generator=gen) * 3)
    limit = torch.randint(0, n + 3, (q,), generator=gen)
    return queries, w, packed, limit


def _paged(packed: torch.Tensor, per_block: int, seed: int) -> StoredKeys:
    """The same entries scattered over shuffled blocks of a larger pool."""
    n, width = packed.shape
    blocks = -(-n // per_block)
    table = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(seed))[:blocks]
    pool = torch.full(
        ((blocks + 3) * per_block, width), 0xFF, dtype=torch.uint8
    )  # unwritten rows: bad scales
    ids = torch.arange(n)
    pool[table[ids // per_block] * per_block + ids % per_block] = packed
    return StoredKeys(pool, table, per_block, n)


def _dense_reference(q, w, keys, limit):
    """The kernel's order written out with Python floats' fp32 rounding, one score at a time."""
    f = torch.float32
    out = torch.full((q.shape[0], keys.shape[0]), NEG)
    for t in range(q.shape[0]):
        for j in range(int(min(limit[t], keys.shape[0]))):
            total = None
            for h in range(q.shape[1]):
                prod = (q[t, h] * keys[j]).view(-1, 8)  # rounded products, lane l holds i ≡ l (mod 8)
                lanes = prod[0].clone()
                for row in prod[1:]:
                    lanes = lanes + row
                r = [lanes[i] + lanes[i + 4] for i in range(4)]
                dot = (r[0] + r[2]) + (r[1] + r[3])
                term = torch.where(dot < 0, torch.zeros((), dtype=f), dot) * w[t, h]
                total = term if total is None else total + term
            out[t, j] = total
    return out


@pytest.mark.parametrize(("q", "h", "d", "n"), [(5, 3, 32, 70), (2, 4, 128, 200), (19, 16, 64, 9)])
def test_dense_scores_compiled_equal_pure_torch_and_the_written_out_order(both, q, h, d, n):
    queries, w, packed, limit = _case(q * n, q, h, d, n)
    compiled, pure = both(index_scores, queries, w, StoredKeys.contiguous(packed), limit)
    assert torch.equal(compiled, pure)
    decoded = mxfp4.decode_index_key(packed)
    assert torch.equal(compiled, _dense_reference(queries, w, decoded, limit))
    # decoded fp32 keys give the same bits as the packed bytes (MXFP4 values decode exactly)
    for got in both(index_scores, queries, w, StoredKeys.contiguous(decoded), limit):
        assert torch.equal(got, compiled)
    visible = torch.arange(n)[None] < limit[:, None]
    assert bool(torch.isfinite(compiled[visible]).all()) and bool((compiled[~visible] == NEG).all())
    old = (torch.einsum("qhd,nd->qhn", queries, decoded).relu() * w[:, :, None]).sum(1)
    assert torch.allclose(compiled[visible], old[visible], rtol=1e-5, atol=1e-4)


def test_paged_keys_score_as_contiguous_ones(both):
    queries, w, packed, limit = _case(7, 33, 4, 128, 150)
    flat = index_scores(queries, w, StoredKeys.contiguous(packed), limit)
    for got in both(index_scores, queries, w, _paged(packed, 16, 1), limit):
        assert torch.equal(got, flat)


def test_gathered_scores_equal_the_dense_ones(both):
    queries, w, packed, limit = _case(3, 40, 4, 64, 120)
    keys = _paged(packed, 8, 2)
    dense = index_scores(queries, w, keys, limit)
    entries = torch.randint(-1, 125, (40, 30), generator=torch.Generator().manual_seed(4))
    compiled, pure = both(index_scores_at, queries, w, keys, entries, limit)
    assert torch.equal(compiled, pure)
    ok = (entries >= 0) & (entries < limit[:, None])
    assert torch.equal(compiled, torch.where(ok, dense.gather(1, entries.clamp(0, 119)), NEG))


def test_each_query_scored_against_its_own_keys_equals_one_call_per_query(both):
    """A batch on different pools: query t reads ``keys[t]`` (other entries, other blocks, its own length)."""
    queries, w, _, _ = _case(5, 6, 4, 64, 1)
    keys = [_paged(_case(20 + t, 1, 4, 64, 9 + 7 * t)[2], 8, t) for t in range(6)]
    entries = torch.randint(-1, 50, (6, 20), generator=torch.Generator().manual_seed(6))
    limit = torch.tensor([0, 5, 16, 30, 60, 40])
    compiled, pure = both(index_scores_each, queries, w, keys, entries, limit)
    assert torch.equal(compiled, pure)
    for t, k in enumerate(keys):
        one = index_scores_at(queries[t : t + 1], w[t : t + 1], k, entries[t : t + 1], limit[t : t + 1])
        assert torch.equal(compiled[t : t + 1], one), t
    assert compiled[3].isfinite().any() and not compiled[0].isfinite().any()


def test_each_query_scoring_every_entry_equals_named_entries_0_to_c(both):
    """``entries`` None (a decode step's dense layers): row t is `index_scores_at` of ``arange(C)`` against
    ``keys[t]``, C the longest key list; −inf past a query's limit and past its own keys."""
    queries, w, _, _ = _case(8, 5, 4, 64, 1)
    keys = [_paged(_case(40 + t, 1, 4, 64, 3 + 11 * t)[2], 8, t) for t in range(5)]
    limit = torch.tensor([0, 14, 9, 99, 30])
    compiled, pure = both(index_scores_each, queries, w, keys, None, limit)
    c = max(k.num_entries for k in keys)
    assert compiled.shape == (5, c) and torch.equal(compiled, pure)
    named = index_scores_each(queries, w, keys, torch.arange(c).expand(5, c), limit)
    assert torch.equal(compiled, named)
    for t, k in enumerate(keys):
        seen = min(int(limit[t]), k.num_entries)
        assert torch.isfinite(compiled[t, :seen]).all() and (compiled[t, seen:] == NEG).all(), t
    assert compiled[3, :25].isfinite().all() and compiled[2, :9].isfinite().all()


def test_host_limits_and_one_query_score_as_without_them(both):
    """``host_limit`` (the limits as host ints) leaves the scores as they are: a limit within [0, N] is not
    clamped again, one past N or below 0 still is; one query scores as its row of a batch; host limits of
    another length raise."""
    queries, w, _, _ = _case(9, 3, 4, 64, 1)
    keys = [_paged(_case(60 + t, 1, 4, 64, 20 + 9 * t)[2], 8, t) for t in range(3)]
    entries = torch.randint(-1, 40, (3, 24), generator=torch.Generator().manual_seed(9))
    limit = torch.tensor([-2, 15, 99])  # below 0, inside, past the request's 38 entries
    for ids in (entries, None):
        want = index_scores_each(queries, w, keys, ids, limit)
        compiled, pure = both(index_scores_each, queries, w, keys, ids, limit, host_limit=limit.tolist())
        assert torch.equal(compiled, want) and torch.equal(pure, want)
        assert want[1].isfinite().any() and not want[0].isfinite().any()
        for t in range(3):
            one = None if ids is None else ids[t : t + 1]
            row = (queries[t : t + 1], w[t : t + 1], keys[t : t + 1], one, limit[t : t + 1])
            alone = index_scores_each(*row, host_limit=[int(limit[t])])
            assert torch.equal(alone, want[t : t + 1, : alone.shape[1]]), t
            assert (want[t, alone.shape[1] :] == NEG).all()
    with pytest.raises(ValueError, match="host_limit"):
        index_scores_each(queries, w, keys, entries, limit, host_limit=[1, 2])


def test_selection_over_a_candidate_pool_equals_the_masked_dense_one():
    queries, w, packed, limit = _case(11, 64, 4, 32, 96)
    keys = StoredKeys.contiguous(packed)
    dense = index_scores(queries, w, keys, limit)
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 24, (64, 3), generator=gen).sort(-1).values
    valid = torch.rand(64, 3, generator=gen) < 0.8
    valid[:, 1:] &= blocks[:, 1:] != blocks[:, :-1]  # distinct valid blocks
    order = (
        (~valid).to(torch.int64).argsort(stable=True, dim=-1)
    )  # valid blocks first, as select_topk returns
    blocks, valid = blocks.gather(1, order), valid.gather(1, order)
    entries = candidate_entries(blocks, valid, block_size=4)
    gathered = index_scores_at(queries, w, keys, entries, limit)
    in_pool = torch.zeros(64, 96, dtype=torch.bool)
    rows = torch.arange(64)[:, None].expand_as(entries)
    in_pool[rows[entries >= 0], entries[entries >= 0]] = True
    for k in (1, 5, 40):
        want = select_topk(dense.masked_fill(~in_pool, NEG), k)
        got = select_topk_at(gathered, entries, k, 96)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_bad_scale_byte_raises_on_both_paths(both, monkeypatch):
    queries, w, packed, _ = _case(1, 2, 2, 32, 10)
    packed[6, 16] = 0  # scale byte of entry 6
    keys = StoredKeys.contiguous(packed)
    for env in ("1", "0"):
        monkeypatch.setenv(native.ENV, env)
        with pytest.raises(ValueError):
            index_scores(queries, w, keys, torch.tensor([10, 3]))
        # an entry no query sees is never read
        assert torch.isfinite(index_scores(queries, w, keys, torch.tensor([6, 3]))[0, :6]).all()


def test_keys_of_another_head_dim_raise_and_fp64_keys_score_as_on_the_pure_torch_path(both, monkeypatch):
    """Rows narrower or wider than q's head dim (the kernel read past each row and reported a false bad scale)
    raise ValueError on both paths; fp64 exact-mode keys (a model run in fp64) are read as values, not as fp32
    bits."""
    queries, w, packed, limit = _case(4, 2, 3, 128, 20)
    narrow = StoredKeys.contiguous(mxfp4.encode_index_key(torch.randn(20, 64)))
    for keys in (narrow, StoredKeys.contiguous(torch.randn(20, 160)), StoredKeys.contiguous(packed[:, :-1])):
        for env in ("1", "0"):
            monkeypatch.setenv(native.ENV, env)
            with pytest.raises(ValueError, match="head dim 128"):
                index_scores(queries, w, keys, limit)
            with pytest.raises(ValueError, match="head dim 128"):
                index_scores_at(queries, w, keys, torch.zeros(2, 3, dtype=torch.int64), limit)
            with pytest.raises(ValueError, match="head dim 128"):
                index_scores_each(queries, w, [keys] * 2, None, limit)
    monkeypatch.delenv(native.ENV)
    decoded = mxfp4.decode_index_key(packed)
    want = index_scores(queries, w, StoredKeys.contiguous(decoded), limit)
    for got in both(index_scores, queries, w, StoredKeys.contiguous(decoded.double()), limit):
        assert _same_bits(got, want)


def test_weights_limits_entries_and_keys_of_other_shapes_raise_on_both_paths(monkeypatch):
    """w, limit or entries not matching q's queries and heads, or fewer keys than queries: the kernel read past w
    and limit (garbage scores), the pure-torch path broadcast a one-element limit, and `index_scores_each` left
    the rows of keyless queries uninitialised."""
    queries, w, packed, limit = _case(6, 3, 2, 64, 10)
    keys = StoredKeys.contiguous(packed)
    entries = torch.zeros(3, 4, dtype=torch.int64)
    for env in ("1", "0"):
        monkeypatch.setenv(native.ENV, env)
        for bad_w, bad_limit in ((w, limit[:1]), (w, torch.cat([limit, limit])), (w[:, :1], limit)):
            with pytest.raises(ValueError, match="take w"):
                index_scores(queries, bad_w, keys, bad_limit)
            with pytest.raises(ValueError, match="take w"):
                index_scores_at(queries, bad_w, keys, entries, bad_limit)
        with pytest.raises(ValueError, match="entries"):
            index_scores_at(queries, w, keys, entries[:1], limit)
        with pytest.raises(ValueError, match="one StoredKeys per query"):
            index_scores_each(queries, w, [keys] * 2, None, limit)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal fp32 bits (±0 told apart) wherever either is a number, and NaN at the same places (a NaN's payload
    depends on operand order, which the contract leaves open: selection reads any NaN as −inf)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _adversarial(seed: int, q: int, h: int, d: int, n: int):
    """Queries with ±0, NaN, ±inf, huge and tiny values; packed keys with every code and the extreme scale bytes
    1 and 252 (subnormal and near-overflow values); weights with zeros; limits 0, partial, all and past the end."""
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(q, h, d, generator=gen)
    pick = torch.rand(q, h, d, generator=gen)
    queries[pick < 0.02] = 0.0
    queries[(pick >= 0.02) & (pick < 0.03)] = -0.0
    queries[(pick >= 0.03) & (pick < 0.04)] *= 1e30
    queries[(pick >= 0.04) & (pick < 0.05)] *= 1e-30
    if q > 1:
        queries[1, 0, d // 2] = float("nan")
        queries[-1, h - 1, 3] = float("inf")
        queries[-1, 0, 5] = float("-inf")
    w = torch.randn(q, h, generator=gen)
    w[torch.rand(q, h, generator=gen) < 0.25] = 0.0
    packed = torch.randint(0, 256, (n, d // 2 + d // 32), dtype=torch.uint8, generator=gen)
    scales = packed[:, d // 2 :]
    scales.copy_(torch.randint(100, 154, scales.shape, dtype=torch.uint8, generator=gen))
    extreme = torch.rand(scales.shape, generator=gen)
    scales[extreme < 0.1] = 1
    scales[extreme > 0.9] = 252
    limit = torch.tensor([0, n, n // 2, n + 5, 1, max(0, n - 1)] * q)[:q]
    return queries, w, packed, limit


@pytest.mark.parametrize(
    ("h", "d", "n"),
    [
        (4, 128, 1),
        (4, 128, 15),
        (4, 128, 16),
        (4, 128, 17),
        (4, 128, 63),
        (4, 128, 64),
        (4, 128, 65),
        (4, 128, 1031),
        (1, 32, 17),
        (2, 64, 65),
        (3, 96, 33),
        (5, 160, 40),
        (7, 256, 129),
        (8, 32, 70),
        (6, 1024, 18),
    ],
)
def test_compiled_scores_have_the_pure_torch_bits_on_adversarial_inputs(both, h, d, n):
    """Every vector/tail split of the 16-entry groups and the 64-entry tasks, 1..8 heads (the kernel's groups of 4
    heads and their remainders), head dims 32..1024, NaN/inf/huge/tiny queries, extreme scale bytes, zero
    weights, per-query limits: dense, named (with −1 holes, repeats and entries past the limit), per-query
    keys, paged keys (power-of-two and other block sizes) and fp32 keys, all bit for bit."""
    q = 6
    queries, w, packed, limit = _adversarial(n * 31 + h * 7 + d, q, h, d, n)
    contiguous = StoredKeys.contiguous(packed)
    compiled, pure = both(index_scores, queries, w, contiguous, limit)
    assert _same_bits(compiled, pure)
    assert torch.isnan(compiled[1]).all()  # a NaN query element reaches every score (limit n)
    assert (compiled[0] == NEG).all()  # limit 0
    _every_layout_agrees(both, queries, w, packed, limit, compiled)


def _every_layout_agrees(both, queries, w, packed, limit, compiled) -> None:
    """Decoded fp32 keys and paged keys (power-of-two and other block sizes) score ``compiled`` (the dense scores of
    the contiguous packed keys) bit for bit; so do named entries (−1 holes, a repeat, entries past the limit) and
    per-query keys, on both paths."""
    q, n = queries.shape[0], packed.shape[0]
    contiguous, decoded = StoredKeys.contiguous(packed), mxfp4.decode_index_key(packed)
    for keys in (StoredKeys.contiguous(decoded), _paged(packed, 8, n), _paged(packed, 6, n + 1)):
        for got in both(index_scores, queries, w, keys, limit):
            assert _same_bits(got, compiled)
    gen = torch.Generator().manual_seed(n + queries.shape[2])
    entries = torch.randint(-1, n + 3, (q, 77), generator=gen)
    entries[:, ::5] = -1
    entries[:, 1] = entries[:, 2]  # a repeated entry
    for keys in (contiguous, _paged(packed, 8, n), _paged(packed, 6, n + 1), StoredKeys.contiguous(decoded)):
        compiled_at, pure_at = both(index_scores_at, queries, w, keys, entries, limit)
        assert _same_bits(compiled_at, pure_at)
        ok = (entries >= 0) & (entries < limit.clamp(max=n)[:, None])
        assert _same_bits(compiled_at, torch.where(ok, compiled.gather(1, entries.clamp(0, n - 1)), NEG))
    each, each_pure = both(index_scores_each, queries, w, [contiguous] * q, None, limit)
    assert _same_bits(each, each_pure) and _same_bits(each, compiled)


def test_fp32_keys_with_non_finite_values_score_as_on_the_pure_torch_path(both):
    """Exact mode reads fp32 rows as they are: ±inf, NaN, ±0 and subnormal key values, 3 heads (a partial head
    group), 45 entries (a partial group of 16), named entries with holes."""
    gen = torch.Generator().manual_seed(9)
    queries, w = torch.randn(4, 3, 64, generator=gen), torch.randn(4, 3, generator=gen)
    keys = torch.randn(45, 64, generator=gen)
    keys[3, 7], keys[10, 0], keys[20, 63], keys[30, 5] = float("inf"), float("-inf"), float("nan"), -0.0
    keys[40] = 1e-40
    limit = torch.tensor([45, 21, 0, 40])
    compiled, pure = both(index_scores, queries, w, StoredKeys.contiguous(keys), limit)
    assert _same_bits(compiled, pure)
    assert compiled[0, 20].isnan() and torch.isfinite(compiled[0, :3]).all() and (compiled[2] == NEG).all()
    entries = torch.tensor([[3, -1, 44, 10, 10], [0, 21, 20, -1, 5], [1, 2, 3, 4, 5], [39, 40, 41, -1, 0]])
    for got in both(index_scores_at, queries, w, StoredKeys.contiguous(keys), entries, limit):
        assert _same_bits(got, torch.where(entries >= 0, compiled.gather(1, entries.clamp(0)), NEG))


# ---- the kernel's integer path (AVX-512 VNNI; calls that score one query per task at head dim >= 128): MXFP4
# queries scored from int8 products where the fp32 order is provably exact, bit for bit the pure-torch path's
# scores wherever it runs or declines: wide block-scale spreads, values near the fp32 limits, exact zero dots and
# their signs, zero blocks and heads, every head group, vector and tile split, dense, named, paged and per-query keys


def _mxfp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] after the MXFP4 round trip, as `Indexer.queries` leaves a query."""
    d = x.shape[-1]
    return mxfp4.decode_index_key(mxfp4.encode_index_key(x.reshape(-1, d))).reshape(x.shape)


def _spread(x: torch.Tensor, spread: int, gen: torch.Generator) -> torch.Tensor:
    """x [..., d] with each 32-value block scaled by 2^k, k uniform in −spread..spread."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    k = torch.randint(-spread, spread + 1, (*blocks.shape[:-1], 1), generator=gen)
    return (blocks * torch.pow(2.0, k.float())).reshape(x.shape)


def _integer_groups() -> int:
    kernels = native.fp4_kernels()
    assert kernels is not None
    return kernels.index_integer_groups()


def _integer_path() -> bool:
    return bool(native.fp4_kernels().index_integer_path())


def _mxfp4_case(seed: int, q: int, h: int, d: int, n: int):
    """MXFP4 queries and keys: most block scales within a few powers of two (the integer path), some spread by up
    to 2^±40 (past its bound), one query at 2^-118 (units below the normal range) and one at 2^88 (sums near
    the fp32 limit), zero blocks, a head of zeros and −0 values; keys with all-zero and all-(−0) entries and ones
    whose dot with query 0's head 0 cancels exactly, entries scaled by 2^30 and 2^-10; weights with zeros, ±inf
    and NaN."""
    gen = torch.Generator().manual_seed(seed)
    raw = _spread(torch.randn(q, h, d, generator=gen), 3, gen)
    raw[q - 1] = _spread(raw[q - 1], 40, gen)
    raw[0, 0, :2] = 1.0  # equal values: key (1, -1, 0, ...) cancels exactly
    raw[1] = raw[1].abs()  # every product with a −0 key is −0
    raw[2] *= 2.0**-118
    raw[3] *= 2.0**88
    raw[torch.rand(q, h, d, generator=gen) < 0.03] = -0.0
    raw[0, h - 1, 32:64] = 0.0  # a block of zeros
    raw[5, h - 1] = 0.0  # a head of zeros: this query keeps the fp32 order
    queries = _mxfp4(raw)
    w = torch.randn(q, h, generator=gen)
    w[torch.rand(q, h, generator=gen) < 0.2] = 0.0
    w[4, 0], w[4, h - 1] = float("inf"), float("nan")
    keys = _spread(torch.randn(n, d, generator=gen), 2, gen)
    keys[n // 3 :: 7] = _spread(keys[n // 3 :: 7], 40, gen)
    keys[1::5] *= 2.0**30  # with the 2^88 query: past the bound's overflow limit, products overflow in fp32
    keys[2::5] *= 2.0**-10  # with the 2^-118 query: units below the normal range
    packed = mxfp4.encode_index_key(keys)
    packed[5::11] = 0  # +0 codes (scale byte 0 is out of range: give them 127)
    packed[5::11, d // 2 :] = 127
    packed[6::11, : d // 2] = 0x88  # −0 codes
    cancel = torch.zeros(d // 2, dtype=torch.uint8)
    cancel[0] = 0xA2  # values +1 (code 2), −1 (code 10)
    packed[7::11, : d // 2] = cancel
    packed[7::11, d // 2 :] = 127
    limit = torch.tensor([n, n // 2, n + 5, max(0, n - 1), n, 1, 0] * q)[:q]
    return queries, w, packed, limit


def _named_groups(entries: torch.Tensor, limit: torch.Tensor, skip: set[int]) -> int:
    """(query, 16-entry group) pairs `index_scores_at` scores with any visible entry, queries in ``skip`` left out
    (groups of 16 within each 64-entry tile of a query's row)."""
    total = 0
    for t in range(entries.shape[0]):
        if t in skip:
            continue
        row = entries[t]
        visible = (row >= 0) & (row < limit[t])
        starts = [
            c for tile in range(0, row.numel(), 64) for c in range(tile, min(tile + 64, row.numel()), 16)
        ]
        total += sum(bool(visible[c : min(c + 16, (c // 64) * 64 + 64)].any()) for c in starts)
    return total


@pytest.mark.parametrize(
    ("h", "d", "n"),
    [
        (4, 128, 1031),
        (1, 128, 17),
        (3, 160, 65),
        (5, 160, 40),
        (8, 256, 129),
        (2, 128, 16),
        (4, 128, 64),
        (6, 1024, 18),
    ],
)
def test_mxfp4_queries_score_with_the_fp32_orders_bits_on_both_paths(both, h, d, n):
    queries, w, packed, limit = _mxfp4_case(h * 1000 + d + n, 7, h, d, n)
    contiguous = StoredKeys.contiguous(packed)
    compiled, pure = both(
        index_scores, queries, w, contiguous, limit
    )  # 7 queries share each task: fp32 order
    assert _same_bits(compiled, pure)
    before = _integer_groups()
    each, each_pure = both(index_scores_each, queries, w, [contiguous] * 7, None, limit)  # one query per call
    ran = _integer_groups() - before
    assert _same_bits(each, each_pure) and _same_bits(each, compiled)
    assert (ran > 0) == _integer_path()  # the integer path ran on these inputs
    _every_layout_agrees(both, queries, w, packed, limit, compiled)


def test_every_group_of_plain_mxfp4_inputs_takes_the_integer_path(both):
    """Keys and queries as the model writes them (block scales within a few powers of two), one query per task:
    every (query, 16-entry group) pair with a visible entry is scored on the integer path, with the pure-torch
    bits; named entries too, query by query; a query that is not MXFP4 and one with a head of zeros keep the fp32
    order."""
    gen = torch.Generator().manual_seed(3)
    raw = torch.randn(6, 4, 128, generator=gen)
    queries = _mxfp4(raw)
    queries[3] = raw[3]  # not on the MXFP4 grid
    queries[4, 2] = 0.0  # a head of zeros
    w = torch.randn(6, 4, generator=gen)
    packed = mxfp4.encode_index_key(torch.randn(500, 128, generator=gen))
    keys = StoredKeys.contiguous(packed)
    limit = torch.tensor([500, 250, 17, 500, 500, 0])
    before = _integer_groups()
    each, each_pure = both(index_scores_each, queries, w, [keys] * 6, None, limit)
    assert _same_bits(each, each_pure)
    groups = sum(-(-int(limit[t]) // 16) for t in (0, 1, 2, 5))
    assert _integer_groups() - before == (groups if _integer_path() else 0)
    entries = torch.randint(-1, 520, (6, 150), generator=gen)
    before = _integer_groups()
    named, named_pure = both(index_scores_at, queries, w, keys, entries, limit)
    assert _same_bits(named, named_pure)
    ok = (entries >= 0) & (entries < limit[:, None])
    assert _same_bits(named, torch.where(ok, each.gather(1, entries.clamp(0, 499)), NEG))
    expected = _named_groups(entries, limit, {3, 4})
    assert expected > 0 and _integer_groups() - before == (expected if _integer_path() else 0)


def test_blocks_of_zeros_anywhere_in_a_head_keep_the_integer_path_and_the_pure_torch_bits(both):
    """Heads (two head groups) whose blocks of zeros (+0 and −0) lie first, last, in the middle or everywhere but
    one block, the nonzero blocks' units near 2^-100: a block of zeros bounds nothing, so every group still takes
    the integer path (a zero block counted with any unit of its own would spread E_b past the bound), with the
    pure-torch bits, dense and named."""
    gen = torch.Generator().manual_seed(7)
    raw = torch.randn(1, 6, 160, generator=gen) * 2.0**-100
    zero_blocks = [[0], [4], [1, 2], [0, 1, 3, 4], [], [2]]
    for h, blocks in enumerate(zero_blocks):
        for b in blocks:
            raw[0, h, 32 * b : 32 * b + 32] = -0.0 if b % 2 else 0.0
    queries = _mxfp4(raw)
    w = torch.rand(1, 6, generator=gen)
    packed = mxfp4.encode_index_key(_spread(torch.randn(70, 160, generator=gen), 1, gen))
    keys = StoredKeys.contiguous(packed)
    limit = torch.tensor([67])
    before = _integer_groups()
    compiled, pure = both(index_scores, queries, w, keys, limit)
    assert _same_bits(compiled, pure) and torch.isfinite(compiled[0, :67]).all()
    assert _integer_groups() - before == (5 if _integer_path() else 0)
    entries = torch.randint(-1, 70, (1, 40), generator=gen)
    named, named_pure = both(index_scores_at, queries, w, keys, entries, limit)
    assert _same_bits(named, named_pure)
    assert _same_bits(
        named, torch.where((entries >= 0) & (entries < 67), compiled.gather(1, entries.clamp(0)), NEG)
    )


def _integer_rule(units: torch.Tensor, a: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Whether the integer path may score each (query, entry): query t's head h has block units ``units[t, h, b]``
    (None-like: a block of zeros where ``a[t, h, b]`` is all 0) and grid integers ``a`` [Q, H, nb, 32]; entry j has
    scale bytes ``scales[j, b]``. Per head, with E_b = u_b + s_b - 128 over the nonzero blocks and spread the
    largest s with (sum 12 |a|) 2^s < 2^24: the exact check (emax - emin <= spread, -126 <= emin <= 104) or the
    group-wide one (S = min_b s_b - 128 over every block, U / M = least / largest u_b: range s + M - U <= spread,
    -126 <= S + U <= 104) holds for every head. Returns (exact, group-wide): bool [Q, N] each; the kernel scores a
    group on the integer path where every visible entry passes the group-wide check, or every one the exact check."""
    nonzero = a.abs().sum(-1) > 0  # [Q, H, nb]
    bound = 12 * a.abs().sum((-1, -2))  # [Q, H]
    spread = torch.zeros_like(bound)
    while bool(((bound << (spread + 1)) < 2**24).any()):
        spread += ((bound << (spread + 1)) < 2**24).long()
    e = units[:, :, None, :] + scales[None, None].long() - 128  # [Q, H, N, nb]
    far = torch.tensor(10**6)
    lo = torch.where(nonzero[:, :, None], e, far).amin(-1)
    hi = torch.where(nonzero[:, :, None], e, -far).amax(-1)
    exact = ((hi - lo) <= spread[..., None]) & (lo >= -126) & (lo <= 104)
    s = scales.long() - 128
    low, rng = s.amin(-1), s.amax(-1) - s.amin(-1)  # [N]
    u_lo = torch.where(nonzero, units, far).amin(-1)  # [Q, H]
    u_hi = torch.where(nonzero, units, -far).amax(-1)
    least = low[None, None] + u_lo[..., None]
    wide = (
        (rng[None, None] + (u_hi - u_lo)[..., None] <= spread[..., None]) & (least >= -126) & (least <= 104)
    )
    return exact.all(1), wide.all(1)


def test_the_integer_paths_checks_at_their_edges_keep_the_pure_torch_bits(both):
    """MXFP4 queries whose least unit puts S + U at -127 / -126 and 104 / 105 against keys whose scale bytes span
    1..4 and 249..252 (subnormal and near-overflow keys), block scales spread to either side of the sum bound, a
    block of zeros with a tiny scale byte under it: every score has the pure-torch bits, and the (query, group)
    pairs the integer path scores are the ones where every visible entry passes the group-wide check, or every one
    the exact check (`_integer_rule`), so a check that admits one entry too many or too few shows."""
    gen = torch.Generator().manual_seed(11)
    h, d, n = 4, 128, 16 * 24
    grid = torch.tensor([1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12])
    cases = [
        (2, [0, 0, 0, 0]),
        (1, [0, 0, 0, 0]),
        (1, [0, 3, 1, 2]),
        (-20, [0, 0, 0, 0]),
        (-21, [0, 1, 0, 1]),
    ]
    cases += [(-19, [0, 2, 0, 0]), (0, [0, 9, 2, 4]), (-3, [0, 5, 0, 0])]
    cases += [(-16, [0, 3, 0, 3]), (3, [0, 8, 0, 8])]  # against the last two groups: only one check passes
    q = len(cases)
    a = grid[torch.randint(0, grid.numel(), (q, h, d // 32, 32), generator=gen)]
    a[..., 0] = 12  # the block's unit is its scale: |a| reaches 12
    units = torch.zeros(q, h, d // 32, dtype=torch.int64)
    for t, (offset, rise) in enumerate(cases):
        units[t] = offset + torch.tensor(rise)
    a[0, 1, 2] = 0  # blocks of zeros: they bound nothing
    a[6, 3, 0] = 0
    queries = (a.float() * torch.pow(2.0, units.float())[..., None]).reshape(q, h, d) * 2.0**-3
    units -= 3
    w = torch.rand(q, h, generator=gen) + 0.5
    packed = torch.randint(0, 256, (n, d // 2 + d // 32), dtype=torch.uint8, generator=gen)
    low = torch.tensor([1, 2, 249, 250, 125, 1, 250, 127]).repeat_interleave(3)  # per group of 16
    width = torch.tensor([0, 3, 0, 2, 8, 0, 1, 20]).repeat_interleave(3)
    first = low.repeat_interleave(16)[:, None] + (
        torch.rand(n, d // 32, generator=gen) * (width.repeat_interleave(16)[:, None] + 1)
    ).long().clamp(max=252 - low.repeat_interleave(16)[:, None])
    packed[:, d // 2 :] = first.clamp(1, 252).to(torch.uint8)
    packed[16 * 5 + 3, d // 2 + 2] = 1  # one entry of an otherwise passing group below the normal range
    # scales falling where the query's units rise: every E_b the same, 105 with query 8 (the exact check fails,
    # emin > 104, the group-wide one passes: S + U = 102) and 5 with query 9, a range of 16 (only the exact one)
    packed[-32:-16, d // 2 :] = torch.tensor([252, 249, 252, 249], dtype=torch.uint8)
    packed[-16:, d // 2 :] = torch.tensor([136, 128, 136, 128], dtype=torch.uint8)
    keys = StoredKeys.contiguous(packed)
    limit = torch.full((q,), n)
    limit[2] = n - 5
    before = _integer_groups()
    each, each_pure = both(index_scores_each, queries, w, [keys] * q, None, limit)
    assert _same_bits(each, each_pure)
    exact, wide = _integer_rule(units, a, packed[:, d // 2 :])
    hidden = torch.arange(n)[None] >= limit[:, None]  # entries past the limit bound nothing
    groups = sum(
        bool((exact | hidden)[t, g : g + 16].all() or (wide | hidden)[t, g : g + 16].all())
        for t in range(q)
        for g in range(0, n, 16)
        if g < limit[t]
    )
    assert 0 < groups < q * n // 16  # both outcomes occur
    assert _integer_groups() - before == (groups if _integer_path() else 0)


def test_a_dot_of_only_negative_zero_products_keeps_its_sign(both):
    """A key of −0 codes against a query of nonnegative values: every product is −0, so the fp32 order's dot is −0
    (relu keeps it, a positive weight too). One exactly cancelling key gives +0. Both on the integer path."""
    gen = torch.Generator().manual_seed(4)
    queries = _mxfp4(torch.randn(1, 1, 128, generator=gen).abs())
    queries[0, 0, :2] = 1.0  # a grid value at both places: the key (+1, −1) below cancels
    w = torch.tensor([[0.5]])
    packed = mxfp4.encode_index_key(torch.randn(16, 128, generator=gen))
    packed[3, :64] = 0x88
    packed[9, :64] = 0
    packed[9, 0] = 0xA2
    packed[9, 64:] = 127
    before = _integer_groups()
    compiled, pure = both(index_scores, queries, w, StoredKeys.contiguous(packed), torch.tensor([16]))
    assert _same_bits(compiled, pure)
    assert compiled[0, 3] == 0 and torch.signbit(compiled[0, 3])
    assert compiled[0, 9] == 0 and not torch.signbit(compiled[0, 9])
    assert _integer_groups() - before == (1 if _integer_path() else 0)


def _runs(packed: torch.Tensor, lengths: list[int], per_block: int, seed: int):
    """Requests whose entries are runs of one shared pool (as `BatchTables` lays a batch out): request b holds
    ``lengths[b]`` entries of ``packed`` in its own shuffled blocks, its table padded to the widest one with the
    next request's blocks. Returns (each request's `StoredKeys`, the shared `StoredKeys`, offsets int64 [B])."""
    width = max(-(-n // per_block) for n in lengths)
    perm = torch.randperm(len(lengths) * width + 2, generator=torch.Generator().manual_seed(seed))
    table = perm[: len(lengths) * width].view(len(lengths), width)
    pool = torch.full((perm.numel() * per_block, packed.shape[1]), 0xFF, dtype=torch.uint8)  # bad scales
    own, start = [], 0
    for b, n in enumerate(lengths):
        ids = torch.arange(n)
        pool[table[b, ids // per_block] * per_block + ids % per_block] = packed[start : start + n]
        own.append(StoredKeys(pool, table[b], per_block, n))
        start += n
    flat = table.flatten()
    offsets = torch.arange(len(lengths)) * width * per_block
    return own, StoredKeys(pool, flat, per_block, flat.numel() * per_block), offsets


@pytest.mark.parametrize("d", [64, 128])
def test_runs_of_one_shared_table_score_as_each_requests_own_keys(both, d):
    """`index_scores_runs` (a batched decode step's dense layers in one call) gives `index_scores_each`'s
    numbers over each run as its own keys, bit for bit, on MXFP4 queries (at d = 128 the integer path) and on
    both paths: limits of 0, inside and at a run's own entries (a limit may not pass them: the caller's
    contract), and a run padded with unwritten rows (bad scale bytes that no query may read)."""
    lengths = [0, 37, 16, 100, 5, 64]
    queries, w, packed, _ = _mxfp4_case(3, len(lengths), 4, d, sum(lengths))
    own, shared, offsets = _runs(packed, lengths, 16, 4)
    lengths_t = torch.tensor(lengths)
    for limit in (lengths_t, torch.tensor([0, 20, 16, 0, 3, 1]), torch.tensor([5, 99, 0, 100, 5, 64])):
        limit = torch.minimum(limit, lengths_t)
        before = _integer_groups()
        compiled, pure = both(index_scores_runs, queries, w, shared, offsets, limit, max(lengths))
        each = index_scores_each(queries, w, own, None, limit)
        assert _same_bits(compiled, each) and _same_bits(pure, each)
        assert (compiled[torch.arange(max(lengths))[None, :] >= limit[:, None]] == NEG).all()
        if d == 128 and int(limit.sum()):
            assert (_integer_groups() > before) == _integer_path()
        with pytest.MonkeyPatch.context() as mp:  # the torch path in column chunks of 7 entries
            mp.setattr("kvdiet.model.index_scores._TORCH_BUDGET", 7 * 4 * d)
            mp.setenv(native.ENV, "0")
            assert _same_bits(index_scores_runs(queries, w, shared, offsets, limit, max(lengths)), each)
    assert (compiled[3, :99] != NEG).all()  # every entry it sees scored


def test_runs_reaching_past_the_keys_or_with_bad_offsets_raise(both, monkeypatch):
    queries, w, packed, _ = _case(5, 2, 2, 32, 30)
    own, shared, offsets = _runs(packed, [10, 20], 8, 1)
    for env in ("1", "0"):
        monkeypatch.setenv(native.ENV, env)
        with pytest.raises(ValueError, match="offsets int64"):
            index_scores_runs(queries, w, shared, offsets.int(), torch.tensor([10, 20]), 20)
        with pytest.raises(ValueError, match="offsets int64"):
            index_scores_runs(queries, w, shared, offsets[:1], torch.tensor([10, 20]), 20)
        with pytest.raises(ValueError, match="reaches past"):
            index_scores_runs(
                queries, w, shared, offsets + shared.num_entries - 20, torch.tensor([10, 20]), 20
            )
        with pytest.raises(ValueError, match="starts before 0"):
            index_scores_runs(queries, w, shared, offsets - 1, torch.tensor([10, 20]), 20)
        with pytest.raises(ValueError, match="reaches past"):  # offsets + limit would wrap past int64
            index_scores_runs(queries, w, shared, torch.tensor([2**63 - 6, 0]), torch.tensor([10, 20]), 20)
    monkeypatch.delenv(native.ENV, raising=False)
    kernels = native.fp4_kernels()  # the kernel refuses such a run itself (a caller past the Python checks)
    for off in ([2**63 - 6, 0], [-1, 0], [0, shared.num_entries - 19]):
        with pytest.raises(RuntimeError, match="outside the table"):
            kernels.index_scores(
                queries,
                w,
                shared.rows,
                shared.table,
                8,
                torch.tensor([10, 20]),
                torch.empty(0, 0, dtype=torch.int64),
                torch.tensor(off),
                torch.empty(2, 20),
                torch.empty(0),
                0,
            )
        with pytest.raises(ValueError, match="offsets int64"):
            index_scores_runs(queries, w, shared, offsets.to("meta"), torch.tensor([10, 20]), 20)
        with pytest.raises(ValueError, match="width >= 0"):
            index_scores_runs(queries, w, shared, offsets, torch.tensor([10, 20]), -1)
        packed_bad = shared.rows.clone()
        row = int(own[1].table[0]) * 8 + 3  # entry 3 of request 1
        packed_bad[row, 16] = 0
        bad = StoredKeys(packed_bad, shared.table, 8, shared.num_entries)
        with pytest.raises(
            ValueError, match=f"entry {int(offsets[1]) + 3} holds" if env == "1" else "scale byte"
        ):
            index_scores_runs(queries, w, bad, offsets, torch.tensor([10, 20]), 20)
        assert index_scores_runs(queries, w, bad, offsets, torch.tensor([10, 3]), 20)[1, :3].isfinite().all()


def test_a_bad_scale_byte_still_raises_with_mxfp4_queries(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    queries = _mxfp4(torch.randn(1, 4, 128, generator=gen))
    w = torch.randn(1, 4, generator=gen)
    packed = mxfp4.encode_index_key(torch.randn(40, 128, generator=gen))
    packed[21, 64 + 2] = 0  # scale byte 0: outside 1..252
    keys = StoredKeys.contiguous(packed)
    for native_on in ("1", "0"):
        monkeypatch.setenv(native.ENV, native_on)
        with pytest.raises(ValueError):
            index_scores(queries, w, keys, torch.tensor([40]))
        # entries 16..20 share the bad entry's group, but an entry no query sees is never read
        assert torch.isfinite(index_scores(queries, w, keys, torch.tensor([21]))[0, :21]).all()


def test_flush_to_zero_keeps_the_fp32_orders_result():
    """Under torch.set_flush_denormal(True) the fp32 order flushes a subnormal key value (E2M1 0.5 under scale byte
    1: 2^-127) to zero, so its score is 0; the integer path, whose exactness needs IEEE subnormals, stands aside and
    the compiled kernel gives the same 0 as the pure-torch path (without the flag both give 24 · 2^-127)."""
    queries = torch.zeros(1, 1, 128)
    queries[0, 0, 0] = 24.0  # 12 · 2^1: MXFP4
    packed = torch.zeros(16, 68, dtype=torch.uint8)
    packed[:, 64:] = 127
    packed[0, 0], packed[0, 64] = 1, 1  # value 0: code 1 (0.5) under scale byte 1
    keys, w, limit = StoredKeys.contiguous(packed), torch.ones(1, 1), torch.tensor([16])
    results = {}
    try:
        for flush in (False, True):
            torch.set_flush_denormal(flush)
            before = _integer_groups()
            with pytest.MonkeyPatch.context() as mp:
                mp.delenv(native.ENV, raising=False)
                compiled = index_scores(queries, w, keys, limit)
                mp.setenv(native.ENV, "0")
                pure = index_scores(queries, w, keys, limit)
            results[flush] = (compiled, pure, _integer_groups() - before)
    finally:
        torch.set_flush_denormal(False)
    for compiled, pure, _ in results.values():
        assert _same_bits(compiled, pure)
    assert results[False][0][0, 0] == 24.0 * 2.0**-127 and results[True][0][0, 0] == 0.0
    assert results[True][2] == 0
    assert results[False][2] == (1 if _integer_path() else 0)


@pytest.mark.parametrize("per_block", [24, 64, 200])
def test_a_long_row_over_many_grains_and_threads_keeps_the_pure_torch_bits_and_selection(both, per_block):
    """One query over paged keys long enough for several of the kernel's parallel grains (2,048 entries each, split
    over the threads): the same bits on 1 and 2 threads and on the pure-torch path, the integer path taken, and the
    same top-k. Keys repeat every 700 entries (tied scores: the lowest index must win), a group of 16 zero keys
    scores ±0, a limit ends mid-grain (−inf past it), and a NaN weight turns a second query's scores to NaN (read
    as −inf by the selection). Blocks of 24 rows: groups of 16 straddle blocks (each row's own address); of 64: every
    64-entry tile one run of rows (one base address a group); of 200: both kinds in one tile."""
    gen = torch.Generator().manual_seed(11)
    n, d, h = 3 * 2048 + 77, 128, 4
    base = _spread(torch.randn(700, d, generator=gen), 2, gen)
    keys = base.repeat(-(-n // 700), 1)[:n]
    keys[64:80] = 0.0  # a 16-entry group of zero keys: every dot ±0
    packed = mxfp4.encode_index_key(keys)
    paged = _paged(packed, per_block, 5)
    queries = _mxfp4(torch.randn(2, h, d, generator=gen))
    w = torch.randn(2, h, generator=gen)
    w[1, 2] = float("nan")
    limit = torch.tensor([n - 1000, n])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = index_scores_each(queries, w, [paged] * 2, None, limit)
        torch.set_num_threads(2)
        before = _integer_groups()
        two, pure = both(index_scores_each, queries, w, [paged] * 2, None, limit)
        ran = _integer_groups() - before
    finally:
        torch.set_num_threads(threads)
    assert _same_bits(two, one) and _same_bits(two, pure)
    assert two[0, int(limit[0]) :].eq(NEG).all() and two[0, : int(limit[0])].isfinite().all()
    assert two[1].isnan().any() and two[0, 64:80].eq(0).all()
    # every group a query sees takes the integer path but the zero keys' (scale byte 1, 2^-127: below its range)
    seen = sum(-(-int(lim) // 16) for lim in limit)
    assert ran == (seen - 2 if _integer_path() else 0)
    # ties: entry j and j + 700 score alike; the top-k keeps the lower one where only one fits
    assert torch.equal(two[0, 100], two[0, 800])
    picked, picked_pure = both(select_topk, two, 512)
    assert torch.equal(picked[0], picked_pure[0]) and torch.equal(picked[1], picked_pure[1])
    assert picked[1][1].logical_not().all()  # the NaN row has no valid entry


def test_named_entries_over_many_tiles_score_as_the_dense_row(both):
    """A candidate consumer's call: one query names thousands of entries in shuffled order (each thread scores
    several 64-entry tiles, the next tile's rows read ahead while one is scored), with empty slots (−1) and entries
    past the limit: the dense row's scores at those entries, −inf elsewhere, on 1 and 2 threads and on the
    pure-torch path."""
    gen = torch.Generator().manual_seed(12)
    n, d, h = 4096 + 37, 128, 4
    packed = mxfp4.encode_index_key(_spread(torch.randn(n, d, generator=gen), 2, gen))
    paged = _paged(packed, 64, 7)
    queries = _mxfp4(torch.randn(1, h, d, generator=gen))
    w = torch.randn(1, h, generator=gen)
    limit = torch.tensor([n - 300])
    entries = torch.randperm(n, generator=gen)[None, : n - 100].clone()
    entries[0, ::9] = -1  # empty slots
    dense = index_scores_each(queries, w, [paged], None, limit)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = index_scores_each(queries, w, [paged], entries, limit)
        torch.set_num_threads(2)
        two, pure = both(index_scores_each, queries, w, [paged], entries, limit)
    finally:
        torch.set_num_threads(threads)
    assert _same_bits(two, one) and _same_bits(two, pure)
    seen = (entries >= 0) & (entries < limit[:, None])
    assert 0 < int(seen.sum()) < entries.numel()
    assert _same_bits(two, torch.where(seen, dense.gather(1, entries.clamp(min=0)), NEG))


@pytest.mark.parametrize("block", [8, 16, 12])
def test_scores_come_with_their_block_maxima_on_every_path(both, block):
    """``maxima``: the scores' block maxima, `block_max`'s bits (NaN read as −inf, −inf past a limit, a last block
    partly filled), taken by the compiled kernel as it scores (blocks of 8 and 16 divide its tiles; blocks of 12
    do not and are taken from the scores after), for one request's keys each and for runs of one shared table,
    and on the pure-torch path too; the scores themselves are unchanged."""
    gen = torch.Generator().manual_seed(21)
    n, d = 2 * 2048 + 37, 128
    packed = mxfp4.encode_index_key(_spread(torch.randn(n, d, generator=gen), 2, gen))
    queries = _mxfp4(torch.randn(2, 4, d, generator=gen))
    w = torch.randn(2, 4, generator=gen)
    w[1, 1] = float("nan")  # the second query's scores all NaN
    limit = torch.tensor([n - 300, n])
    paged = _paged(packed, 64, 3)
    _, shared, offsets = _runs(packed, [n - 10, 10], 64, 4)
    calls = {
        "each": lambda m: index_scores_each(queries, w, [paged] * 2, None, limit, maxima=m),
        "runs": lambda m: index_scores_runs(
            queries, w, shared, offsets, torch.tensor([n - 300, 10]), n - 10, maxima=m
        ),
    }
    for name, call in calls.items():
        plain = call(None)
        got = {}
        for path, env in (("compiled", None), ("pure", "0")):
            with pytest.MonkeyPatch.context() as mp:
                if env is None:
                    mp.delenv(native.ENV, raising=False)
                else:
                    mp.setenv(native.ENV, env)
                maxima = torch.full((2, -(-plain.shape[1] // block)), 7.0)
                scores = call((maxima, block))
            assert _same_bits(scores, plain), (name, path)
            want = block_max(plain, block)
            assert torch.equal(maxima.view(torch.int32), want.view(torch.int32)), (name, path)
            got[path] = maxima
        assert got["compiled"][1].eq(NEG).all() if name == "each" else got["compiled"][1, 2:].eq(NEG).all()
    # the kernel's tasks of 16 queries over one tile (a dense call of many queries, no offsets), compiled only
    many = _mxfp4(torch.randn(17, 4, d, generator=gen))
    weights, limits = torch.randn(17, 4, generator=gen), torch.randint(0, n + 1, (17,), generator=gen)
    maxima = torch.full((17, -(-n // block)), 7.0)
    scores = _native(many, weights, StoredKeys.contiguous(packed), limits, None, n, maxima=(maxima, block))
    assert scores is not None and torch.equal(
        maxima.view(torch.int32), block_max(scores, block).view(torch.int32)
    )


# ---- the integer path's AMX tile products (index_kernels.cpp: amx_expand .. amx_finish): the bits of the vector
# dots and of pure torch; on a CPU without AMX-INT8 the same cases check the other paths and the AMX counter stays

AMX_ENV = "KVDIET_INDEX_AMX"


def _amx_case(seed: int, heads: int, n: int):
    """One MXFP4 query (block scales within 2^±1: AMX's reach), weights with a zero, and n packed keys: most within
    2^±1 of their block scales, every 37th spread by 2^±6 (a rise past 3: the vector path), an all-zero entry, an
    entry of −0 codes and one whose dot with head 0 cancels exactly (a zero dot's sign: zero_dot)."""
    gen = torch.Generator().manual_seed(seed)
    raw = _spread(torch.randn(1, heads, 128, generator=gen), 1, gen)
    raw[0, 0, :2] = 1.0
    raw[0, -1, 64:96] = 0.0  # a block of zeros
    w = torch.randn(1, heads, generator=gen)
    w[0, heads // 2] = 0.0
    keys = _spread(torch.randn(n, 128, generator=gen), 1, gen)
    keys[::37] = _spread(keys[::37], 6, gen)
    packed = mxfp4.encode_index_key(keys)
    packed[3, :64], packed[3, 64:] = 0, 127  # +0 codes
    packed[4, :64], packed[4, 64:] = 0x88, 127  # −0 codes
    packed[5, :64], packed[5, 64:] = 0, 127
    packed[5, 0] = 0xA2  # values +1, −1: cancels against the query's (1, 1, ...)
    return _mxfp4(raw), w, packed


def _three_ways(monkeypatch, fn, *args, counts: list[int] | None = None):
    """fn's result with AMX products (where this CPU has them), without, and on the pure-torch path; ``counts``
    (given) gets added the (query, group) pairs scored by AMX products, on the integer path with them, and on it
    without them."""
    kernels = native.fp4_kernels()
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.delenv(AMX_ENV, raising=False)
    amx0, int0 = kernels.index_amx_groups(), _integer_groups()
    with_amx = fn(*args)
    amx1, int1 = kernels.index_amx_groups(), _integer_groups()
    monkeypatch.setenv(AMX_ENV, "0")
    vector = fn(*args)
    int2 = _integer_groups()
    monkeypatch.setenv(native.ENV, "0")
    pure = fn(*args)
    monkeypatch.delenv(native.ENV)
    monkeypatch.delenv(AMX_ENV)
    for i, v in enumerate((amx1 - amx0, int1 - int0, int2 - int1)):
        if counts is not None:
            counts[i] += v
    return with_amx, vector, pure


@pytest.mark.parametrize("heads", [4, 1, 3, 16, 20, 33])
def test_amx_products_score_with_the_other_paths_bits(both, monkeypatch, heads):
    """Dense (contiguous and paged, power-of-two blocks and not, smaller and larger than a group of 16), named
    entries and every limit: the same bits three ways; AMX takes the plain groups, and each group holding an entry
    it may not take goes to the vector path within the same call."""
    n = 301
    query, w, packed = _amx_case(heads, heads, n)
    layouts = [StoredKeys.contiguous(packed)]
    layouts += [_paged(packed, size, heads + i) for i, size in enumerate((8, 6, 32, 40))]
    counts = [0, 0, 0]
    for keys in layouts:
        for limit in (n, 200, 17, 0):
            got = _three_ways(monkeypatch, index_scores, query, w, keys, torch.tensor([limit]), counts=counts)
            assert _same_bits(got[0], got[2]) and _same_bits(got[1], got[2])
            assert (got[0][0, limit:] == NEG).all()
    amx_groups, integer_with, integer_without = counts
    groups = len(layouts) * sum(-(-limit // 16) for limit in (n, 200, 17))  # (query, group) pairs
    # the integer path (AVX-512 VNNI) takes the same groups either way, AMX some of them (a group with a spread
    # entry: not); without it, neither runs
    assert integer_with == integer_without
    assert groups // 2 < integer_with <= groups if _integer_path() else integer_with == 0
    assert (0 < amx_groups < integer_with) if native.fp4_kernels().index_amx_path() else amx_groups == 0
    entries = torch.randint(-1, n + 2, (1, 90), generator=torch.Generator().manual_seed(heads))
    for keys in layouts:
        got = _three_ways(monkeypatch, index_scores_at, query, w, keys, entries, torch.tensor([n]))
        assert _same_bits(got[0], got[2]) and _same_bits(got[1], got[2])


def test_queries_past_amx_reach_keep_the_vector_path(both, monkeypatch):
    """A query whose block scales lie more than 2^3 apart (a << rise would not fit an int8) is never taken by AMX
    products, with the same bits; several queries of one call each decide on their own."""
    kernels = native.fp4_kernels()
    query, w, packed = _amx_case(7, 4, 64)
    far = query.clone()
    far[0, 2, 96:] *= 2.0**5
    queries, weights = torch.cat([query, far]), torch.cat([w, w])
    keys = StoredKeys.contiguous(packed)
    before = kernels.index_amx_groups()
    got = _three_ways(monkeypatch, index_scores_each, far, w, [keys], None, torch.tensor([64]))
    assert _same_bits(got[0], got[2]) and _same_bits(got[1], got[2])
    assert kernels.index_amx_groups() == before
    got = _three_ways(
        monkeypatch, index_scores_each, queries, weights, [keys] * 2, None, torch.tensor([64, 64])
    )
    assert _same_bits(got[0], got[2]) and _same_bits(got[1], got[2])
    assert (kernels.index_amx_groups() > before) == bool(kernels.index_amx_path())
