"""A request's window rings kept in two tensors (`WindowRings`)."""

from __future__ import annotations

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
