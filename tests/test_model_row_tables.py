"""`RowTables`: what the layers of one forward call share from a request's rows (the RoPE rotations, the window
bands' mask) is the very tensor each layer would compute."""

from __future__ import annotations

import torch

from kvdiet.config import load_config
from kvdiet.model.layers import Rope
from kvdiet.model.row_tables import RowTables
from kvdiet.model.transformer import Transformer


def test_layers_of_one_rope_table_share_one_rotation_with_its_bits() -> None:
    """Two layers' own `Rope` objects of one table get one `Rotation` (the first's), bit for bit `Rope.at`'s; a
    layer of another base gets its own."""
    cfg = load_config("v4.1-micro")
    pos = torch.arange(5, 300)
    tables = RowTables()
    plain, plain_again, compressed = Rope.for_layer(cfg, 0), Rope.for_layer(cfg, 0), Rope.for_layer(cfg, 4)
    assert plain is not plain_again and plain.base != compressed.base
    first = tables.rotation(plain, pos)
    assert tables.rotation(plain_again, pos) is first
    other = tables.rotation(compressed, pos)
    assert other is not first and tables.rotation(compressed, pos) is other
    for rope, rot in ((plain, first), (compressed, other)):
        want = rope.at(pos)
        assert torch.equal(torch.view_as_real(rot.cis), torch.view_as_real(want.cis))
        assert torch.equal(torch.view_as_real(rot.cis_inverse), torch.view_as_real(want.cis_inverse))
    assert not torch.equal(torch.view_as_real(first.cis), torch.view_as_real(other.cis))


def test_band_mask_is_made_once_per_window_and_floor() -> None:
    """The mask is ``make()``'s of the first call for a (window, floor); another floor or window makes its own."""
    tables, made = RowTables(), []

    def make(value: bool):
        def run() -> torch.Tensor:
            made.append(value)
            return torch.full((3, 8), value)

        return run

    first = tables.band_mask(8, 0, make(True))
    assert tables.band_mask(8, 0, make(False)) is first and bool(first.all())
    assert not bool(tables.band_mask(8, 5, make(False)).any())
    assert not bool(tables.band_mask(4, 0, make(False)).any())
    assert made == [True, False, False]


def test_window_band_with_tables_gives_the_mask_of_its_own_rows() -> None:
    """With no entry before the rows, `Attention.window_band` takes the tables' mask: the same as without tables,
    for every floor; with ring entries before the rows it computes its own."""
    attn = Transformer.from_config(load_config("v4.1-micro"), seed=0, exact=True).layers[0].attn
    pos = torch.arange(0, 21)
    kv = torch.arange(21 * 4, dtype=torch.float32).view(21, 4)
    tables = RowTables()
    for floor in (0, 3, 0, 9):
        band, mask = attn.window_band(kv, pos, pos, floor, tables)
        want_band, want_mask = attn.window_band(kv, pos, pos, floor)
        assert torch.equal(band, want_band) and torch.equal(mask, want_mask)
    assert tables.band_mask(attn.window, 3, lambda: torch.zeros(0)).shape == (21, attn.window)
    older = torch.tensor([-1, 0, 1])
    later = torch.arange(2, 21)
    win_pos = torch.cat([older, later])
    band, mask = attn.window_band(kv[:22], win_pos, later, 0, RowTables())
    want_band, want_mask = attn.window_band(kv[:22], win_pos, later, 0)
    assert torch.equal(band, want_band) and torch.equal(mask, want_mask)
