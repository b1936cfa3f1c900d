"""The index scan's AMX products (``formats/index_kernels.cpp``: `amx_expand`, `amx_multiply`, `amx_finish`) give
the bits of the vector integer path and of the pure-torch fp32 order, on every layout and head count, and hand
back to those paths each group they may not take. On a CPU without AMX-INT8 the same cases check the other paths
against each other and the AMX counter stays still."""

from __future__ import annotations

import pytest
import torch

from kvdiet.formats import mxfp4, native
from kvdiet.model.index_scores import StoredKeys, index_scores, index_scores_at, index_scores_each

AMX_ENV = "KVDIET_INDEX_AMX"


def _kernels():
    kernels = native.fp4_kernels()
    assert kernels is not None, "the FP4 kernels did not build"
    return kernels


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _scaled(x: torch.Tensor, spread: int, gen: torch.Generator) -> torch.Tensor:
    """x [..., 128] with each 32-value block times 2^k, k uniform in −spread..spread."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    k = torch.randint(-spread, spread + 1, (*blocks.shape[:-1], 1), generator=gen)
    return (blocks * torch.pow(2.0, k.float())).reshape(x.shape)


def _case(seed: int, heads: int, n: int):
    """One MXFP4 query (block scales within 2^±1: AMX's reach), weights with a zero, and n packed keys: most within
    2^±1 of their block scales, every 37th spread by 2^±6 (a rise past 3: the vector path), an all-zero entry, an
    entry of −0 codes and one whose dot with head 0 cancels exactly (a zero dot's sign: zero_dot)."""
    gen = torch.Generator().manual_seed(seed)
    raw = _scaled(torch.randn(1, heads, 128, generator=gen), 1, gen)
    raw[0, 0, :2] = 1.0
    raw[0, -1, 64:96] = 0.0  # a block of zeros
    query = mxfp4.decode_index_key(mxfp4.encode_index_key(raw.reshape(-1, 128))).reshape(raw.shape)
    w = torch.randn(1, heads, generator=gen)
    w[0, heads // 2] = 0.0
    keys = _scaled(torch.randn(n, 128, generator=gen), 1, gen)
    keys[::37] = _scaled(keys[::37], 6, gen)
    packed = mxfp4.encode_index_key(keys)
    packed[3, :64], packed[3, 64:] = 0, 127  # +0 codes
    packed[4, :64], packed[4, 64:] = 0x88, 127  # −0 codes
    packed[5, :64], packed[5, 64:] = 0, 127
    packed[5, 0] = 0xA2  # values +1, −1: cancels against the query's (1, 1, ...)
    return query, w, packed


def _paged(packed: torch.Tensor, per_block: int, seed: int) -> StoredKeys:
    """The same entries over shuffled blocks of a larger pool (unwritten rows: bad scale bytes)."""
    n, width = packed.shape
    blocks = -(-n // per_block)
    table = torch.randperm(blocks + 2, generator=torch.Generator().manual_seed(seed))[:blocks]
    pool = torch.full(((blocks + 2) * per_block, width), 0xFF, dtype=torch.uint8)
    ids = torch.arange(n)
    pool[table[ids // per_block] * per_block + ids % per_block] = packed
    return StoredKeys(pool, table, per_block, n)


def _three_ways(monkeypatch, fn, *args, counts: list[int] | None = None):
    """fn's result with AMX products (where this CPU has them), without, and on the pure-torch path; ``counts``
    (given) gets added the (query, group) pairs scored by AMX products, on the integer path with them, and on it
    without them."""
    kernels = _kernels()
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.delenv(AMX_ENV, raising=False)
    amx0, int0 = kernels.index_amx_groups(), kernels.index_integer_groups()
    with_amx = fn(*args)
    amx1, int1 = kernels.index_amx_groups(), kernels.index_integer_groups()
    monkeypatch.setenv(AMX_ENV, "0")
    vector = fn(*args)
    int2 = kernels.index_integer_groups()
    monkeypatch.setenv(native.ENV, "0")
    pure = fn(*args)
    monkeypatch.delenv(native.ENV)
    monkeypatch.delenv(AMX_ENV)
    for i, v in enumerate((amx1 - amx0, int1 - int0, int2 - int1)):
        if counts is not None:
            counts[i] += v
    return with_amx, vector, pure


@pytest.mark.parametrize("heads", [4, 1, 3, 16, 20, 33])
def test_amx_products_score_with_the_other_paths_bits(monkeypatch, heads):
    """Dense (contiguous and paged, power-of-two blocks and not), named entries and every limit: the same bits
    three ways; AMX takes the plain groups, and each group holding an entry it may not take goes to the vector
    path within the same call."""
    kernels = _kernels()
    n = 301
    query, w, packed = _case(heads, heads, n)
    layouts = [StoredKeys.contiguous(packed), _paged(packed, 8, heads), _paged(packed, 6, heads + 1)]
    counts = [0, 0, 0]
    for keys in layouts:
        for limit in (n, 200, 17, 0):
            got = _three_ways(monkeypatch, index_scores, query, w, keys, torch.tensor([limit]), counts=counts)
            assert _same_bits(got[0], got[2]) and _same_bits(got[1], got[2])
            assert (got[0][0, limit:] == float("-inf")).all()
    amx_groups, integer_with, integer_without = counts
    groups = 3 * sum(-(-limit // 16) for limit in (n, 200, 17))  # (query, group) pairs: three layouts
    # the integer path (AVX-512 VNNI) takes the same groups either way, AMX some of them (a group with a spread
    # entry: not); without it, neither runs
    assert integer_with == integer_without
    assert groups // 2 < integer_with <= groups if kernels.index_integer_path() else integer_with == 0
    assert (0 < amx_groups < integer_with) if kernels.index_amx_path() else amx_groups == 0
    entries = torch.randint(-1, n + 2, (1, 90), generator=torch.Generator().manual_seed(heads))
    for keys in layouts:
        got = _three_ways(monkeypatch, index_scores_at, query, w, keys, entries, torch.tensor([n]))
        assert _same_bits(got[0], got[2]) and _same_bits(got[1], got[2])


def test_queries_past_amx_reach_keep_the_vector_path(monkeypatch):
    """A query whose block scales lie more than 2^3 apart (a << rise would not fit an int8) is never taken by AMX
    products, with the same bits; several queries of one call each decide on their own."""
    kernels = _kernels()
    query, w, packed = _case(7, 4, 64)
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
