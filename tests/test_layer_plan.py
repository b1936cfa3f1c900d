"""Layer roles and sources (issue: foundation, point 3; v41-spec §1.2–1.3)."""

from __future__ import annotations

from kvdiet.config import load_config
from kvdiet.layer_plan import LayerPlan, Role

REUSE_V41 = [
    *range(3, 8),
    *range(9, 14),
    *range(15, 20),
    21,
    22,
    23,
    25,
    26,
    27,
    29,
    30,
    31,
    33,
    34,
    35,
    37,
    38,
    39,
]


def test_v41_roles_exact() -> None:
    plan = LayerPlan.from_config(load_config("deepseek-v4.1-flash"))
    assert len(plan) == 40  # the 3 trailing ratio entries (40–42) are DSpark blocks, not layers
    assert plan.ids(Role.SWA_ONLY) == [0, 1]
    assert plan.ids(Role.FULL) == [2, 8, 14, 20]
    assert plan.ids(Role.REINDEX) == [24, 28, 32, 36]
    assert plan.ids(Role.REUSE) == REUSE_V41
    assert len(plan.ids(Role.REUSE)) == 30
    assert plan.decoder_start == 20
    assert plan.encoder_layers == list(range(20))


def test_v41_sources_and_candidates() -> None:
    plan = LayerPlan.from_config(load_config("deepseek-v4.1-flash"))
    expected = {
        0: (None, None, None),
        2: (2, 2, None),
        7: (2, 2, None),
        8: (8, 8, None),
        19: (14, 14, None),
        20: (20, 20, "source"),
        21: (20, 20, None),
        24: (20, 24, "consumer"),
        27: (20, 24, None),
        36: (20, 36, "consumer"),
        38: (20, 36, None),
        39: (20, 36, None),
    }
    for layer, (kv, idx, cand) in expected.items():
        info = plan[layer]
        assert (info.kv_src, info.idx_src, info.candidate) == (kv, idx, cand), layer
    assert plan[38].compress_ratio == 1 and plan[38].role is Role.REUSE  # not SWA-only (v41-spec §1.2 [X])
    assert plan[20].owns_compressed_kv and plan[20].owns_index_keys and plan[20].owns_indexer
    assert not plan[24].owns_compressed_kv and not plan[24].owns_index_keys and plan[24].owns_indexer
    assert not plan[25].owns_indexer and not plan[25].owns_compressed_kv
    assert plan.kv_sources == [2, 8, 14, 20]


def test_v4_roles() -> None:
    plan = LayerPlan.from_config(load_config("deepseek-v4-flash"))
    assert len(plan) == 43
    assert plan.ids(Role.SWA_ONLY) == [0, 1]
    assert plan.ids(Role.CSA) == list(range(2, 43, 2))
    assert plan.ids(Role.HCA) == list(range(3, 42, 2))
    assert len(plan.ids(Role.CSA)) == 21 and len(plan.ids(Role.HCA)) == 20
    assert plan[3].idx_src is None and plan[3].kv_src == 3  # HCA attends all entries, no indexer
    assert plan[4].idx_src == 4 and plan.decoder_start is None


def test_micro_covers_every_role() -> None:
    plan = LayerPlan.from_config(load_config("v4.1-micro"))
    roles = {info.role for info in plan.layers}
    assert roles == {Role.SWA_ONLY, Role.FULL, Role.REINDEX, Role.REUSE}
    assert {plan[i].compress_ratio for i in plan.ids(Role.FULL)} == {1, 2}
    assert [i.layer_id for i in plan.layers if i.candidate == "source"] == [5]
    assert [i.layer_id for i in plan.layers if i.candidate == "consumer"] == [7]
