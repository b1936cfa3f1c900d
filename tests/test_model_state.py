"""A request's window rings kept in two tensors (`WindowRings`)."""

from __future__ import annotations

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.model.state import WindowRings
from kvdiet.model.transformer import Transformer


def _rings() -> WindowRings:
    model = Transformer.from_config(load_config("v4.1-micro"), seed=0)
    return WindowRings(model.codecs.window, 4, 3)


def test_each_ring_views_its_layer_of_the_two_tensors() -> None:
    rings = _rings()
    assert len(rings) == 3 and (rings.positions == -1).all() and (rings.rows == 0).all()
    rings[1].write(torch.ones(2, rings[1].codec.dim), torch.tensor([5, 6]))
    assert rings.positions.tolist() == [[-1] * 4, [-1, 5, 6, -1], [-1] * 4]
    assert torch.equal(rings.rows[1, 1:3], rings[1].rows[1:3]) and rings.rows[1, 1:3].any()
    rings[1].clear()
    assert (rings.positions == -1).all() and (rings.rows == 0).all()


def test_store_step_writes_every_layer_at_the_positions_slot_and_logs_in_layer_order() -> None:
    rings = _rings()
    rows = torch.arange(3 * rings.rows.shape[2], dtype=torch.uint8).view(3, -1)
    rings.store_step(rows, 9)
    assert rings.positions.tolist() == [[-1, 9, -1, -1]] * 3
    assert torch.equal(rings.rows[:, 1], rows) and not rings.rows[:, [0, 2, 3]].any()
    log: list[tuple[torch.Tensor, torch.Tensor]] = []
    for ring in rings:
        ring.log = log
    rings.store_step(rows + 1, 10)
    assert [p.tolist() for _, p in log] == [[10]] * 3
    assert torch.equal(torch.cat([r for r, _ in log]), rows + 1) and torch.equal(rings.rows[:, 2], rows + 1)


def test_layer_rows_are_the_rings_own_views() -> None:
    rings = _rings()
    assert all(view is ring.rows for view, ring in zip(rings.layer_rows, rings, strict=True))
    rings.layer_rows[2][3] = 7
    assert (rings.rows[2, 3] == 7).all() and not rings.rows[:2].any()


def test_store_steps_stores_what_store_step_would_for_each_request() -> None:
    batch, twins = [_rings() for _ in range(3)], [_rings() for _ in range(3)]
    log: list[tuple[torch.Tensor, torch.Tensor]] = []
    for ring in batch[1]:  # a logging request among plain ones: stored one by one, logged in layer order
        ring.log = log
    twin_log: list[tuple[torch.Tensor, torch.Tensor]] = []
    for ring in twins[1]:
        ring.log = twin_log
    width = batch[0].rows.shape[2]
    rows = torch.arange(3 * 3 * width, dtype=torch.uint8).view(3, 3, width)  # [layers, B, width]
    positions = [9, 6, 0]
    WindowRings.store_steps(batch, rows, positions)
    for b, twin in enumerate(twins):
        twin.store_step(rows[:, b], positions[b])
    for got, want in zip(batch, twins, strict=True):
        assert torch.equal(got.rows, want.rows) and torch.equal(got.positions, want.positions)
    assert (
        batch[0].positions.tolist() == [[-1, 9, -1, -1]] * 3 and batch[2].positions[:, 0].tolist() == [0] * 3
    )
    assert torch.equal(batch[2].rows[:, 0], rows[:, 2]) and [p.tolist() for _, p in log] == [[6]] * 3
    assert torch.equal(torch.cat([r for r, _ in log]), rows[:, 1])


def test_store_steps_refuses_a_position_count_that_differs_before_writing() -> None:
    batch = [_rings() for _ in range(2)]
    rows = torch.ones(3, 2, batch[0].rows.shape[2], dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 rings and 1 positions for 2 rows"):
        WindowRings.store_steps(batch, rows, [4])
    assert all((r.positions == -1).all() and not r.rows.any() for r in batch)


def test_store_steps_refuses_rows_unlike_a_ring_before_writing() -> None:
    """A logging ring among them, and a ring that fits first: no ring is written, none logs."""
    batch = [_rings() for _ in range(2)]
    log: list[tuple[torch.Tensor, torch.Tensor]] = []
    for ring in batch[0]:
        ring.log = log
    width = batch[0].rows.shape[2]
    for rows in (
        torch.ones(3, 2, width + 1, dtype=torch.uint8),  # another width
        torch.ones(2, 2, width, dtype=torch.uint8),  # another layer count
        torch.ones(3, 2, width, dtype=torch.int16),  # another dtype
    ):
        with pytest.raises(ValueError, match="do not fit a ring's"):
            WindowRings.store_steps(batch, rows, [4, 5])
    assert not log and all((r.positions == -1).all() and not r.rows.any() for r in batch)
