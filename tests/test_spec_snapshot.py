"""The byte accounting's window snapshot (`CacheSpec.snapshot_bytes`, what the trace study stores and what the
planner's snapshot policies persist) against the bytes the model's snapshot writer produces, V4.1 and V4-Flash,
at positions across every tail's cycle."""

from __future__ import annotations

import struct

import pytest
import torch

from kvdiet.cache.policies import BoundarySnapshot, Checkpoint
from kvdiet.cache.spec import CacheSpec
from kvdiet.config import load_config
from kvdiet.model.snapshot import snapshot_bytes
from kvdiet.model.transformer import Transformer
from kvdiet.model.v4 import V4Transformer
from v4_helpers import tiny_v4_config

POSITIONS = (1, 2, 3, 5, 8, 9, 63, 64, 65, 127, 128, 129, 130, 192, 200, 256, 290)


def _written(state, fingerprint: bytes = b"kvdiet") -> tuple[int, int]:
    """(all bytes, bytes besides the JSON header) of a snapshot of ``state``."""
    data = snapshot_bytes(state, fingerprint)
    (header,) = struct.unpack_from("<I", data, 8)
    return len(data), len(data) - header


def _models():
    v4 = tiny_v4_config().replace(head_dim=128, qk_rope_head_dim=64, index_head_dim=64)
    return {
        "v4.1-micro": Transformer.from_config(load_config("v4.1-micro"), seed=3),
        "v4-tiny": V4Transformer.from_config(v4, seed=5),
    }


@pytest.mark.parametrize("name", ["v4.1-micro", "v4-tiny"])
def test_spec_snapshot_bytes_are_what_the_model_writes(name) -> None:
    model = _models()[name]
    spec = CacheSpec.from_config(model.cfg)
    sizes = spec.snapshot_sizes()
    positions = [p for p in POSITIONS if p <= model.cfg.max_position_embeddings]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (positions[-1],), generator=gen).tolist()
    state, done = model.new_state(), 0
    written = {}
    for pos in positions:
        model.prefill(state, ids[done:pos])
        done = pos
        total, payload = _written(state)
        assert payload == spec.snapshot_bytes(pos) == sizes(pos), pos
        assert total - payload < 1024  # the JSON header, not counted
        # the planner's per-snapshot bytes: one boundary, one checkpoint, at this position
        assert BoundarySnapshot().persistent_window_bytes(spec, pos, boundaries=[pos]) == payload, pos
        assert Checkpoint(pos).persistent_window_bytes(spec, pos, boundaries=()) == payload, pos
        written[pos] = payload
    assert len(set(written.values())) > 1  # the rows the tails hold change with the position
    # a session's snapshots, each at its own position
    end = positions[-1]
    session = BoundarySnapshot().persistent_window_bytes(spec, end, boundaries=positions)
    assert session == sum(written.values())
    every = [p for p in (64, 128, 192, 256) if p <= end]
    assert Checkpoint(64).persistent_window_bytes(spec, end, boundaries=()) == sum(written[p] for p in every)
    if name == "v4-tiny":  # a CSA layer's last complete window is kept at a block boundary
        assert spec.snapshot_bytes(256) > spec.snapshot_bytes(0) + 8 * len(spec.tails)


def test_snapshot_sizes_table_equals_the_formula_everywhere() -> None:
    for name in ("deepseek-v4-flash", "deepseek-v4.1-flash", "v4-mini", "v4.1-micro"):
        spec = CacheSpec.from_config(load_config(name))
        sizes = spec.snapshot_sizes()
        assert [sizes(n) for n in range(0, 2000, 7)] == [spec.snapshot_bytes(n) for n in range(0, 2000, 7)]
