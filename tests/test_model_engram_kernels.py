"""Engram's compiled calls (``formats/engram_kernels.cpp``): the table lookup, the hash and the gate of a decode
step's rows, each with the bits of its torch formula (``KVDIET_NATIVE_KERNELS=0``), and the torch path's errors."""

from __future__ import annotations

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.formats import native
from kvdiet.model.engram import Engram, Fp8Embedding
from kvdiet.model.engram_hash import EngramHasher


@pytest.fixture(scope="module")
def micro():
    return load_config("v4.1-micro")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _table(rows: int, dim: int, seed: int) -> Fp8Embedding:
    """A table of every E4M3 byte (NaN codes 0x7F and 0xFF too) and scale bytes over 0..254 (2^-127 .. 2^127)."""
    gen = torch.Generator().manual_seed(seed)
    table = Fp8Embedding(rows, dim)
    table.weight.copy_(torch.randint(0, 256, (rows, dim), generator=gen, dtype=torch.uint8))
    table.weight[0] = torch.arange(dim, dtype=torch.uint8) * (256 // dim)  # spread codes in one row
    table.weight[1, :2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
    table.scale.copy_(torch.randint(0, 255, (rows, dim // 32), generator=gen, dtype=torch.uint8))
    table.scale[2] = 0  # 2^-127: subnormal products, some rounded
    table.scale[3] = 254
    return table


def test_table_rows_have_the_torch_lookups_bits(both) -> None:
    table = _table(50, 64, 1)
    ids = torch.tensor([[0, 1, 2, 3, 49], [7, 7, 3, 0, 12]])
    compiled, pure = both(table, ids)
    assert compiled.shape == (2, 5, 64) and _same_bits(compiled, pure)
    assert compiled[0, 1, :2].isnan().all() and (compiled[0, 2] != 0).any()


def test_a_bad_id_or_scale_byte_raises_the_torch_paths_error(both) -> None:
    table = _table(8, 32, 2)
    for bad in (torch.tensor([8]), torch.tensor([-9])):
        with pytest.raises(IndexError):
            both(table, bad)
    table.scale[5, 0] = 255
    with pytest.raises(ValueError, match="255"):
        both(table, torch.tensor([1, 5]))


@pytest.mark.parametrize("shape", [(1, 3), (4, 2, 7), (2, 0)])
def test_hashed_rows_have_the_torch_formulas_ids(micro, both, shape) -> None:
    """Any leading dims and chunk lengths (none too), ids across the compressed vocab: the wrapping products, the
    XOR folds and the divisor-signed remainders as torch's int64 ops."""
    hasher = EngramHasher(micro)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(
        0, hasher.compressed_vocab_size, (*shape[:-1], shape[-1] + hasher.history_len), generator=gen
    )
    for layer in hasher.layer_ids:
        compiled, pure = both(hasher.row_ids, layer, ids)
        assert compiled.shape == (*shape, hasher.n_cols) and torch.equal(compiled, pure)


def test_hashed_rows_wrap_as_torch_on_huge_ids(micro, both) -> None:
    """Ids near 2^62 (products far past int64): the compiled fold wraps as torch's does."""
    hasher = EngramHasher(micro)
    ids = torch.tensor([[2**62 + 12345, -(2**61), 2**63 - 1, 7, -3]])
    compiled, pure = both(hasher.row_ids, hasher.layer_ids[0], ids)
    assert torch.equal(compiled, pure)


@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_the_gate_has_the_torch_formulas_bits(micro, both, rows) -> None:
    """A decode step's rows (17: past the kernel's rows, the formula itself): streams of ordinary, zero and
    huge values, keys giving dots of either sign and exact zeros (the ±0 sign, the 1e-6 clamp)."""
    engram = Engram(micro, micro.engram_layer_ids[0])
    gen = torch.Generator().manual_seed(4 + rows)
    engram.q_weight.data = torch.randn(engram.hc_mult, engram.hidden, generator=gen)
    h = torch.randn(rows, engram.hc_mult, engram.hidden, generator=gen)
    h[0, 0] = 0.0  # a zero stream: its dot is 0
    if rows > 2:
        h[1] *= 1e18
        h[2, 1] = -h[2, 1]
    row_ids = torch.randint(0, engram.embed.rows, (rows, engram.n_cols), generator=gen)
    with torch.no_grad():
        # the last row's stream 0 orthogonal to its weighted key: a dot of rounding size, under the 1e-6 clamp
        key = engram.wkv(engram.embed(row_ids[-1:]).flatten(-2))[0, : engram.hidden]
        u = engram.q_weight[0] * engram.k_weight[0] * key
        h[-1, 0] -= (h[-1, 0] @ u) / (u @ u) * u
        compiled, pure = both(engram, h, row_ids)
    assert _same_bits(compiled, pure)
    assert not _same_bits(compiled, h)  # the gate moved the streams


def test_the_gate_leaves_nan_and_autograd_to_the_formula(micro, both) -> None:
    engram = Engram(micro, micro.engram_layer_ids[0])
    h = torch.randn(2, engram.hc_mult, engram.hidden)
    h[1, 0, 3] = float("nan")
    row_ids = torch.zeros(2, engram.n_cols, dtype=torch.int64)
    with torch.no_grad():
        compiled, pure = both(engram, h, row_ids)
    assert torch.equal(compiled.isnan(), pure.isnan()) and compiled[1, 0].isnan().all()
    assert torch.equal(compiled.nan_to_num(), pure.nan_to_num())
    kernels = native.fp4_kernels()
    kv = torch.randn(2, (engram.hc_mult + 1) * engram.hidden)
    assert (
        kernels.engram_gate(h, kv, engram.q_weight, engram.k_weight, engram.eps) is None
    )  # NaN out: declined
    grad = engram(torch.randn(2, engram.hc_mult, engram.hidden, requires_grad=True), row_ids)
    assert grad.requires_grad  # the formula ran, keeping the graph
