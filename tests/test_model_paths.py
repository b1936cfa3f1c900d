"""Cached paths of the V4.1 model against the no-cache reference (DESIGN.md §6; cases B04, B05, B06, B26, B27)."""

from __future__ import annotations

import pytest
import torch

from kvdiet.cache.spec import CacheSpec
from kvdiet.config import load_config
from kvdiet.model.attention import Attention, grouped_product
from kvdiet.model.reference import ReferenceTrace, forward_full
from kvdiet.model.transformer import Transformer

TOL = 1e-4
# Causality checks: a leak moves logits by ~1e-2 here. Positions before the change differ only by fp32
# reassociation (the MoE groups tokens per expert, so a changed token changes an expert's batch shape).
CAUSAL_TOL = 1e-6


def _tokens(n: int, seed: int = 1, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=[True, False], ids=["exact", "quantized"])
def micro(request) -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=0, exact=request.param)


@pytest.fixture(scope="module")
def micro_exact() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=0, exact=True)


def test_decode_equals_reference_at_every_position(micro: Transformer) -> None:
    toks = _tokens(48)
    ref = forward_full(micro, toks)
    state = micro.new_state()
    dec = torch.stack([micro.decode([state], [t])[0] for t in toks.tolist()])
    worst = (dec - ref).abs().amax(-1)  # [48]
    # A decode row's products run in another fp32 order than the reference's many-row ones
    # (kvdiet.model.gemv): with quantised caches a value within an ulp of a rounding boundary may then round to
    # the other code, moving that one position's logits by up to a code step (~1e-3 here). A wrong cache path
    # moves most positions by ~1e-2; exact caches have no boundary to cross.
    assert int((worst > TOL).sum()) <= (0 if micro.exact else 1)
    assert worst.max().item() <= (TOL if micro.exact else 2e-3)
    assert state.num_tokens == 48


def test_prefill_runs_the_head_on_its_last_row_only(micro_exact: Transformer) -> None:
    toks = _tokens(20, seed=4)
    every = micro_exact.prefill(micro_exact.new_state(), toks, decoder_replay=False, all_logits=True)
    rows: list[int] = []
    hook = micro_exact.head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    try:
        last = micro_exact.prefill(micro_exact.new_state(), toks, decoder_replay=False)
    finally:
        hook.remove()
    assert rows == [1] and last.shape == every[-1].shape
    assert (last - every[-1]).abs().max().item() <= 1e-6  # the same row, its products in the decode order
    assert (last - every[-2]).abs().max().item() > 1e-3


def test_chunked_prefill_at_every_split_equals_one_shot(micro: Transformer) -> None:
    toks = _tokens(44, seed=2)
    state = micro.new_state()
    one_shot = micro.prefill(state, toks, decoder_replay=False, all_logits=True)
    assert (one_shot - forward_full(micro, toks)).abs().max().item() <= TOL
    splits = range(1, 44) if micro.exact else (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 43)
    for split in splits:
        state = micro.new_state()
        a = micro.prefill(state, toks[:split], decoder_replay=False, all_logits=True)
        b = micro.prefill(state, toks[split:], decoder_replay=False, all_logits=True)
        assert (torch.cat([a, b]) - one_shot).abs().max().item() <= TOL, split


def test_three_chunks_then_decode(micro_exact: Transformer) -> None:
    m, toks = micro_exact, _tokens(40, seed=3)
    ref = forward_full(m, toks)
    state = m.new_state()
    m.prefill(state, toks[:13], decoder_replay=False)
    m.prefill(state, toks[13:14], decoder_replay=False)
    last = m.prefill(state, toks[14:30], decoder_replay=False)
    assert (last - ref[29]).abs().max().item() <= TOL
    for t in range(30, 40):
        assert (m.decode([state], [int(toks[t])])[0] - ref[t]).abs().max().item() <= TOL


def test_batched_decode_of_different_lengths(micro_exact: Transformer) -> None:
    m = micro_exact
    prompts = [_tokens(n, seed=n) for n in (5, 17, 30)]
    states = [m.new_state() for _ in prompts]
    for s, p in zip(states, prompts, strict=True):
        m.prefill(s, p[:-1], decoder_replay=False)
    batched = m.decode(states, [int(p[-1]) for p in prompts])
    for row, p in zip(batched, prompts, strict=True):
        assert (row - forward_full(m, p)[-1]).abs().max().item() <= TOL


def _visible_sets(trace: ReferenceTrace, layer: int) -> list[set[int]]:
    idx, valid = trace.topk[layer]
    return [set(i[v].tolist()) for i, v in zip(idx, valid, strict=True)]


def test_b05_visibility_ratio_2(micro_exact: Transformer) -> None:
    m, toks = micro_exact, _tokens(7, seed=4)
    trace = ReferenceTrace()
    base = forward_full(m, toks, trace)
    expected = [set(), {0}, {0}, {0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2}]
    assert _visible_sets(trace, 1) == expected  # layer 1: Full, ratio 2, top-4 > visible
    changed = toks.clone()
    changed[5] = (changed[5] + 1) % 64
    assert (forward_full(m, changed)[:5] - base[:5]).abs().max().item() <= CAUSAL_TOL
    changed = toks.clone()
    changed[3] = (changed[3] + 1) % 64
    assert (forward_full(m, changed)[:3] - base[:3]).abs().max().item() <= CAUSAL_TOL


def test_b05_visibility_ratio_4() -> None:
    cfg = load_config("v4.1-micro").replace(compress_ratios=[0, 4, 4, 4, 4, 1, 1, 1, 1])
    m = Transformer.from_config(cfg, seed=0, exact=True)
    toks = _tokens(13, seed=5)
    trace = ReferenceTrace()
    base = forward_full(m, toks, trace)
    for t, got in enumerate(_visible_sets(trace, 1)):
        assert got == set(range(min(4, (t + 1) // 4))), t
    for t in range(1, 13):  # changing token t never moves an earlier position
        changed = toks.clone()
        changed[t] = (changed[t] + 1) % 64
        assert (forward_full(m, changed)[:t] - base[:t]).abs().max().item() <= CAUSAL_TOL, t
    state = m.new_state()
    for s in range(0, 13, 3):
        out = m.prefill(state, toks[s : s + 3], decoder_replay=False, all_logits=True)
        assert (out - base[s : s + 3]).abs().max().item() <= TOL


@pytest.mark.parametrize("length", [5, 7, 8, 9])
def test_b04_short_prompts(micro: Transformer, length: int) -> None:
    toks = _tokens(length, seed=length)
    state = micro.new_state()
    last = micro.prefill(state, toks, decoder_replay=False)
    trace = ReferenceTrace()
    ref = forward_full(micro, toks, trace)
    assert len(state.main[1]) == length // 2 == trace.entries[1].shape[0]
    assert len(state.main[5]) == length  # ratio-1 source
    if micro.exact:
        assert torch.allclose(state.main[1].read(), trace.entries[1], atol=1e-5)
    assert (last - ref[-1]).abs().max().item() <= TOL


def test_b06_state_accumulates_across_chunks_and_decode(micro_exact: Transformer) -> None:
    m, toks = micro_exact, _tokens(28, seed=6)
    chosen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = Attention.select

    def spy(self, q_idx, w, seg):  # record layer 1's selections
        out = original(self, q_idx, w, seg)
        if self.info.layer_id == 1:
            chosen.append(out)
        return out

    Attention.select = spy
    try:
        one = m.new_state()
        m.prefill(one, toks[:24], decoder_replay=False)
        one_shot = chosen.pop()
        chunked = m.new_state()
        for s in range(0, 24, 8):
            m.prefill(chunked, toks[s : s + 8], decoder_replay=False)
        third = chosen[-1]
        counts = []
        for t in range(24, 28):
            m.decode([chunked], [int(toks[t])])
            counts.append(len(chunked.main[1]))
    finally:
        Attention.select = original
    assert torch.equal(third[0][:, : one_shot[0].shape[1]], one_shot[0][16:])
    assert torch.equal(third[1][:, : one_shot[1].shape[1]], one_shot[1][16:])
    assert (third[0][third[1]] < 8).any()  # chunk 3 selects entries 0–7, written by earlier chunks
    assert counts == [12, 13, 13, 14]  # entry 12 appears at position 25, entry 13 at 27
    whole = m.new_state()
    m.prefill(whole, toks, decoder_replay=False)
    assert torch.allclose(chunked.main[1].raw(), whole.main[1].raw(), atol=1e-5)
    assert torch.allclose(chunked.index_keys[1].raw(), whole.index_keys[1].raw(), atol=1e-5)


def test_cache_bytes_match_planner_micro(micro: Transformer) -> None:
    state = micro.new_state()
    micro.prefill(state, _tokens(40, seed=7))
    measured = state.cache_bytes()
    spec = CacheSpec.from_config(micro.cfg)
    if not micro.exact:
        assert measured.global_bytes_per_token == spec.global_bytes_per_token == 106.0
        assert measured.window_bytes == spec.window_bytes_per_request
        assert measured.global_bytes == spec.global_bytes(40)
    assert set(state.main) == {1, 3, 5}  # Full layers only; Reuse (2, 4, 6, 8) and Reindex (7) own no KV
    assert measured.tail_bytes == spec.tail_bytes_per_request


def test_reuse_layers_own_no_kv(micro_exact: Transformer) -> None:
    for block in micro_exact.layers:
        role = block.info.role.value
        assert (block.attn.compressor is not None) == (role == "full")
        assert (block.attn.indexer is not None) == (role in ("full", "reindex"))
        if role == "reindex":
            assert block.attn.indexer.wk is None


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [
        ([], "empty prompt"),
        ([3, 64], "token id 64 at index 1 is outside the vocabulary [0, 64)"),
        ([-1], "token id -1 at index 0"),
        ([2**31], f"token id {2**31} at index 0"),
    ],
)
def test_b26_b27_bad_input_changes_nothing(micro_exact: Transformer, tokens: list[int], needle: str) -> None:
    m = micro_exact
    state = m.new_state()
    m.prefill(state, [5, 6, 7])
    before = (
        state.num_tokens,
        len(state.main[1]),
        state.windows[0].positions.clone(),
        state.engram_history.clone(),
    )
    with pytest.raises(ValueError) as err:
        m.prefill(state, tokens)
    assert needle in str(err.value)
    with pytest.raises(ValueError):
        m.decode([state], [t for t in tokens if not 0 <= t < 64][:1] or [-5])
    after = (state.num_tokens, len(state.main[1]), state.windows[0].positions, state.engram_history)
    assert before[:2] == after[:2] and torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])
    fresh = m.new_state()
    assert (m.prefill(fresh, [5, 6, 7]) - forward_full(m, [5, 6, 7])[-1]).abs().max().item() <= TOL


def test_context_limit(micro_exact: Transformer) -> None:
    m = micro_exact
    state = m.new_state()
    limit = m.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=f"{limit + 1} > max_position_embeddings {limit}"):
        m.prefill(state, [1] * (limit + 1))
    assert state.num_tokens == 0


def test_decoder_replay_keeps_global_kv_exact(micro: Transformer) -> None:
    toks = _tokens(40, seed=8)
    full, bounded = micro.new_state(), micro.new_state()
    full_logits = micro.prefill(full, toks, decoder_replay=False)
    replay_logits = micro.prefill(bounded, toks)
    for layer in full.main:
        assert torch.equal(full.main[layer].raw(), bounded.main[layer].raw())
        assert torch.equal(full.index_keys[layer].raw(), bounded.index_keys[layer].raw())
    drift = (full_logits - replay_logits).abs().max().item()
    assert 0.0 < drift < 1.0  # truncated decoder windows move the last logits a little, never wildly
    # encoder windows are exact; decoder rings hold only the kept rows' entries
    for layer in range(micro.plan.decoder_start):
        assert torch.equal(full.windows[layer].rows, bounded.windows[layer].rows)


def test_mini_measures_890_bytes_per_token() -> None:
    from kvdiet.model.build import load_model

    model, tokenizer = load_model("v4.1-mini", seed=0)
    assert tokenizer is not None and tokenizer.vocab_size == model.cfg.vocab_size == 129_280
    state = model.new_state()
    ids = [
        tokenizer.bos_token_id,
        *tokenizer.encode("DeepSeek-V4.1 keeps 890 bytes of global KV per token. " * 4),
    ]
    ids = ids[: len(ids) // 2 * 2]  # an even count: no ratio-2 pair left open
    model.prefill(state, ids)
    measured = state.cache_bytes()
    assert measured.global_bytes_per_token == 890.0 == CacheSpec.from_config(model.cfg).global_bytes_per_token
    assert measured.window_bytes == 2_703_360
    assert measured.per_layer[20] == (len(ids) * 288, len(ids) * 68)
    model.decode([state], [5])  # an odd count: one ratio-2 pair is open and holds no entry yet
    odd = state.cache_bytes()
    assert odd.global_bytes_per_token == (len(ids) * 890 + 356) / (len(ids) + 1) < 890.0
    assert odd.global_bytes_per_covered_token == 890.0
    assert odd.covered_tokens[2] == len(ids) and odd.covered_tokens[20] == len(ids) + 1


def test_batched_decode_on_one_pool_equals_private_pools_bit_for_bit(micro: Transformer) -> None:
    """Requests sharing a pool (an engine) are scored and gathered in one call over their block tables end to
    end (`BatchTables`); requests on private pools one by one: the same logits and caches to the bit."""
    pool = micro.new_pool(1)
    prompts = [_tokens(n, seed=n) for n in (3, 18, 41, 70)]  # ragged: no entries yet, and past one block
    shared = [micro.new_state(pool) for _ in prompts]
    private = [micro.new_state() for _ in prompts]
    for s, p, q in zip(shared, private, prompts, strict=True):
        micro.prefill(s, q)
        micro.prefill(p, q)
    for step in range(5):
        tokens = [(7 * step + b) % 64 for b in range(len(prompts))]
        assert torch.equal(micro.decode(shared, tokens), micro.decode(private, tokens)), step
    for s, p in zip(shared, private, strict=True):
        assert torch.equal(s.windows.rows, p.windows.rows) and torch.equal(
            s.windows.positions, p.windows.positions
        )
        for layer in s.main:
            assert torch.equal(s.main[layer].raw(), p.main[layer].raw())
            assert torch.equal(s.index_keys[layer].raw(), p.index_keys[layer].raw())


@pytest.mark.parametrize("floor", [0, 13, 16])
def test_window_band_reads_what_the_dense_window_mask_reads(micro_exact: Transformer, floor: int) -> None:
    """Each query's band holds exactly the keys `window_mask` lets it read over the whole window (ring entries
    with empty slots and a gap, then the new rows), under a bounded-replay floor too."""
    attn = micro_exact.layers[0].attn
    w, d = attn.window, 4
    pos = torch.arange(16, 23)  # the new rows
    older = torch.tensor([-1, -1, 9, 10, 12, 13, 14, 15])  # two empty slots, position 11 missing
    win_pos = torch.cat([older, pos])
    win_kv = torch.arange(win_pos.numel() * d, dtype=torch.float32).view(-1, d)
    band, mask = attn.window_band(win_kv, win_pos, pos, floor)
    dense = attn.window_mask(pos, win_pos, floor)
    assert band.shape == (pos.numel(), w, d) and mask.shape == (pos.numel(), w)
    for i in range(pos.numel()):
        want = win_kv[dense[i]]
        assert torch.equal(band[i][mask[i]], want), i
    assert int(mask.sum()) == int(dense.sum()) > pos.numel()  # some query reads ring entries too


@pytest.mark.parametrize("t", [1, 2, 7])
@pytest.mark.parametrize("g", [1, 2, 8])
def test_grouped_product_equals_einsum_bit_for_bit(t: int, g: int) -> None:
    """`project_out`'s grouped ``wo_a`` product skips einsum's parsing but must run einsum's very product."""
    gen = torch.Generator().manual_seed(t * 10 + g)
    o = torch.randn(t, g, 1024, generator=gen)
    w = torch.randn(g, 64, 1024, generator=gen)
    got = grouped_product(o, w)
    want = torch.einsum("tgd,grd->tgr", o, w)
    assert got.shape == (t, g, 64) and torch.equal(got.reshape(t, -1), want.reshape(t, -1))
    assert not torch.equal(got, grouped_product(o, w.flip(1)))


def test_decode_plan_shares_one_rotation_per_table_and_reads_each_ring_slot(micro_exact: Transformer) -> None:
    """A decode step computes the RoPE rotation of its positions once per table (ratio-0 and compressed layers
    differ) and every layer's window rows and mask once: a ring slot is read where it holds its position (≥ the
    window floor), else the layer's new row, masked out."""
    from kvdiet.model.attention import Segment
    from kvdiet.model.decode_step import DecodePlan

    m, w = micro_exact, micro_exact.cfg.sliding_window
    states = [m.new_state() for _ in range(2)]
    m.prefill(states[0], _tokens(3))
    m.prefill(states[1], _tokens(20))
    segs = [Segment(s, torch.tensor([s.num_tokens])) for s in states]
    segs[1].window_floor = 15  # its older positions 13 … 19 are held; 13 and 14 are below the floor
    plan = DecodePlan.for_segments(segs)
    ropes = {info.compress_ratio > 0: m.layers[info.layer_id].attn.rope for info in m.plan.layers}
    first, again = plan.rotation(ropes[True]), plan.rotation(ropes[True])
    plain = plan.rotation(ropes[False])
    assert first is again and plain is not first and plan.rotation(ropes[False]) is plain
    assert torch.equal(first.cis, ropes[True].at(torch.tensor([3, 20])).cis)
    layers = len(m.plan.layers)
    for layer in (0, layers - 1):
        mask = plan.window_mask[layer]
        assert mask[0].tolist() == [False] * (w - 4) + [True] * 4  # positions −4 … −1, 0 … 2, the new one
        assert mask[1].tolist() == [False] * 2 + [True] * (w - 2)  # 13, 14, then 15 … 19, the new one
        assert plan.window_held[layer].tolist() == [m[:-1] for m in mask.tolist()]
    assert plan.window_slots.tolist() == [[p % w for p in range(4 - w, 3)], [p % w for p in range(13, 20)]]


def test_decode_plan_closes_each_ratios_groups_once_from_host_positions(micro_exact: Transformer) -> None:
    """`DecodePlan.closing_groups`: at ratio r the requests whose row t closes a group (t % r == r − 1) and the
    rotation at their groups' first positions t − r + 1, made once per step; every request and the step's own
    rotation at ratio 1; no rotation where no group closes."""
    from kvdiet.model.attention import Segment
    from kvdiet.model.decode_step import DecodePlan

    m = micro_exact
    states = [m.new_state() for _ in range(3)]
    for s, n in zip(states, (3, 20, 7), strict=True):
        m.prefill(s, _tokens(n, seed=n))
    segs = [Segment(s, torch.tensor([s.num_tokens])) for s in states]
    plan = DecodePlan.for_segments(segs)
    rope = m.layers[m.plan.kv_sources[0]].attn.rope
    done, rot = plan.closing_groups(rope, 2, segs)
    assert done == [0, 2] and torch.equal(rot.cis, rope.at(torch.tensor([2, 6])).cis)
    assert plan.closing_groups(rope, 2, segs)[1] is rot  # once per step
    done4, rot4 = plan.closing_groups(rope, 4, segs)  # 3 % 4 == 3 and 7 % 4 == 3 close; 20 does not
    assert done4 == [0, 2] and torch.equal(rot4.cis, rope.at(torch.tensor([0, 4])).cis)
    assert plan.closing_groups(rope, 1, segs) == ([0, 1, 2], plan.rotation(rope))
    one = DecodePlan.for_segments(segs[1:2])
    assert one.closing_groups(rope, 2, segs[1:2]) == ([], None)


@pytest.mark.parametrize("floor", [0, 15])
def test_decode_window_reads_the_ring_in_position_order_then_the_new_entry(
    micro: Transformer, floor: int
) -> None:
    """`_window` gathers each request's ring straight from its `WindowRings`: held older positions in position
    order (their stored values), a slot not held (never written, below the floor) as the new entry, masked out,
    and the new entry last as its stored value (``roundtrip``), staged as ``encode(roundtrip(kv))``."""
    from kvdiet.model.attention import Segment
    from kvdiet.model.decode_step import DecodePlan, _window

    m, w = micro, micro.cfg.sliding_window
    states = [m.new_state() for _ in range(3)]
    for s, n in zip(states, (3, 20, 45), strict=True):
        m.prefill(s, _tokens(n, seed=n))
    gen = torch.Generator().manual_seed(floor)
    for batch in (states, states[2:]):  # request 0 holds 3 of its w − 1 older slots; request 2 all
        segs = [Segment(s, torch.tensor([s.num_tokens]), window_floor=floor) for s in batch]
        plan = DecodePlan.for_segments(segs)
        assert (plan.window_held is None) == (len(batch) == 1)
        for layer in (0, len(m.plan.layers) - 1):
            attn = m.layers[layer].attn
            codec, raw = (
                attn.codecs.window,
                torch.randn(len(batch), attn.head_dim, generator=gen).clamp(-3.5, 3.5),
            )
            raw[:, 0] = 3.6  # block 0: amax/s = 3.6·2^6 = 230.4 rounds to the E4M3 code 224
            keys, mask = _window(attn, plan, raw)
            kv = codec.roundtrip(raw)  # the stored value: the new key, stored as encode(kv)
            assert keys.shape == (len(batch), w, attn.head_dim) and torch.equal(mask, plan.window_mask[layer])
            assert torch.equal(plan.fresh[layer], codec.encode(kv))
            # FP8 re-encodes a block whose top code is 224 at half the scale: encode(raw) is not what is stored
            assert m.exact or not torch.equal(plan.fresh[layer], codec.encode(raw))
            for b, state in enumerate(batch):
                ring_kv, ring_pos = state.windows[layer].read()
                t = state.num_tokens
                for j, p in enumerate(range(t - w + 1, t)):
                    held = p >= floor and bool((ring_pos == p).any())
                    want = ring_kv[ring_pos == p][0] if held else kv[b]
                    assert bool(mask[b, j]) == held and torch.equal(keys[b, j], want), (layer, b, p)
                assert bool(mask[b, -1]) and torch.equal(keys[b, -1], kv[b])


def test_decode_plan_takes_each_layers_rings_once_and_stores_only_a_complete_step(micro: Transformer) -> None:
    """`DecodePlan.layer_rings` are views of each request's rings (`_window` reads the rings in place), and
    `store_windows` refuses a step in which a layer staged nothing, before any ring is written; with every layer
    staged it writes each layer's entries at the new position's slot."""
    from kvdiet.model.attention import Segment
    from kvdiet.model.decode_step import DecodePlan

    m = micro
    states = [m.new_state() for _ in range(2)]
    for s, n in zip(states, (5, 30), strict=True):
        m.prefill(s, _tokens(n, seed=n))
    segs = [Segment(s, torch.tensor([s.num_tokens])) for s in states]
    plan = DecodePlan.for_segments(segs)
    layers, w, width = states[0].windows.rows.shape
    dtype = states[0].windows.rows.dtype
    assert len(plan.layer_rings) == len(plan.fresh) == len(plan.window_mask) == layers
    for layer, rings in enumerate(plan.layer_rings):
        for b, ring in enumerate(rings):
            want = states[b].windows.rows[layer]
            assert ring.data_ptr() == want.data_ptr() and ring.shape == want.shape == (w, width)
    before = [s.windows.rows.clone() for s in states]
    gen = torch.Generator().manual_seed(3)
    for layer in range(layers - 1):  # the last layer stages nothing
        plan.fresh[layer] = torch.randint(0, 120, (2, width), generator=gen, dtype=dtype)
    with pytest.raises(RuntimeError, match="store_windows before every layer staged"):
        plan.store_windows(segs)
    assert all(torch.equal(s.windows.rows, b) for s, b in zip(states, before, strict=True))
    plan.fresh[layers - 1] = torch.randint(0, 120, (2, width), generator=gen, dtype=dtype)
    plan.store_windows(segs)
    for b, s in enumerate(states):
        slot = s.num_tokens % w
        for layer in range(layers):
            assert torch.equal(s.windows.rows[layer, slot], plan.fresh[layer][b])
            assert int(s.windows.positions[layer, slot]) == s.num_tokens


def _window_and_staged(attn: Attention, plan, raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`_window`'s keys and mask, and the entries it staged (a copy)."""
    from kvdiet.model.decode_step import _window

    keys, mask = _window(attn, plan, raw)
    return keys, mask, plan.fresh[attn.info.layer_id].clone()


@pytest.mark.parametrize("floor", [0, 15])
def test_decode_window_compiled_equals_the_torch_path(both, micro: Transformer, floor: int) -> None:
    """`_window` through the compiled window read (`fp8.read_window`, quantised) gives the keys, mask and staged
    entries of the torch path (`Codec.read_window` without it: the code `_window` ran before) bit for bit, at B =
    3 (request 0 holds 3 of its w − 1 older slots) and B = 1, each layer's keys in the plan's one buffer."""
    from kvdiet.formats import fp8
    from kvdiet.model.attention import Segment
    from kvdiet.model.decode_step import DecodePlan

    m = micro
    states = [m.new_state() for _ in range(3)]
    for s, n in zip(states, (3, 20, 45), strict=True):
        m.prefill(s, _tokens(n, seed=n))
    gen = torch.Generator().manual_seed(floor)
    for batch in (states, states[2:]):
        segs = [Segment(s, torch.tensor([s.num_tokens]), window_floor=floor) for s in batch]
        plan = DecodePlan.for_segments(segs)
        for layer in range(len(m.plan.layers)):
            attn = m.layers[layer].attn
            raw = torch.randn(len(batch), attn.head_dim, generator=gen)
            raw[:, 0] = 3.6  # a block whose top code is 224 (re-encoded at half the scale)
            with torch.no_grad():  # as a decode step runs (under autograd no buffer is lent)
                (keys, mask, fresh), (want_keys, want_mask, want_fresh) = both(
                    _window_and_staged, attn, plan, raw
                )
            assert torch.equal(keys.view(torch.int32), want_keys.view(torch.int32))
            assert torch.equal(mask, want_mask) and torch.equal(fresh, want_fresh)
            # every layer's fused read writes the step's one buffer
            assert (keys.data_ptr() == plan.window_keys.data_ptr()) != m.exact
            graded = DecodePlan.for_segments(segs)
            assert _window_and_staged(attn, graded, raw)[0].data_ptr() != keys.data_ptr()
            assert graded.window_keys is None
            rings = [r.rows[layer] for r in plan.rings]
            held = None if plan.window_held is None else plan.window_held[layer]
            fused = fp8.read_window(raw, rings, plan.window_slots, held)
            assert (attn.codecs.window.fused_read is None) == m.exact and (fused is not None) != m.exact


def test_a_decode_step_reads_parametrized_weights_as_the_modules_do() -> None:
    """``torch.nn.utils.parametrize`` takes a parameter out of its module's ``_parameters`` and computes it on
    access: a decode step of a model whose floating weights (every ``weight``, the attention sinks, the Engram
    gate weights) are parametrized as twice their values gives the logits of the same model with those weights
    doubled in place, bit for bit (the decode glue reads them through `member`, not the parameters' dicts)."""
    from torch import nn
    from torch.nn.utils import parametrize

    class Twice(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2.0

    def logits(parametrized: bool) -> tuple[torch.Tensor, set[str]]:
        m = Transformer.from_config(load_config("v4.1-micro"), seed=0, exact=False)
        names = set()
        for _, mod in list(m.named_modules()):
            for name in ("weight", "attn_sink", "q_weight", "k_weight"):
                p = mod._parameters.get(name)
                if p is None or not p.dtype.is_floating_point:
                    continue
                names.add(f"{type(mod).__name__}.{name}")
                if parametrized:
                    parametrize.register_parametrization(mod, name, Twice())
                else:
                    with torch.no_grad():
                        p.mul_(2.0)
        state = m.new_state()
        with torch.no_grad():
            return torch.stack([m.decode([state], [t])[0] for t in _tokens(6, seed=4).tolist()]), names

    want, names = logits(False)
    got, _ = logits(True)
    assert {
        "Gate.weight",
        "Engram.q_weight",
        "Attention.attn_sink",
        "RMSNorm.weight",
        "Linear.weight",
    } <= names
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_forward_hooks_see_the_same_calls_on_the_compiled_and_torch_paths(micro_exact: Transformer) -> None:
    """A forward hook on any module runs on every call the module path would make: with a counting hook on every
    module, a prefill and batched decode steps call each module as often with the compiled kernels as on the
    pure-torch path (``KVDIET_NATIVE_KERNELS=0``), and the logits are those of the unhooked compiled run, bit
    for bit (the hooks return None)."""
    from torch.nn.modules import module as nn_module

    from kvdiet.formats import native

    assert native.fp4_kernels() is not None, "the compiled kernels did not build"

    def run() -> torch.Tensor:
        states = [micro_exact.new_state() for _ in range(3)]
        for i, state in enumerate(states):
            micro_exact.prefill(state, _tokens(20 + i, seed=i))
        return torch.cat([micro_exact.decode(states, [t, t + 1, t + 2]) for t in (4, 7, 9)])

    with torch.no_grad():
        plain = run()
        counts: dict[str, dict[int, int]] = {"compiled": {}, "torch": {}}
        for path in counts:
            seen = counts[path]
            handle = nn_module.register_module_forward_hook(
                lambda module, args, out, seen=seen: seen.__setitem__(id(module), seen.get(id(module), 0) + 1)
            )
            try:
                with pytest.MonkeyPatch.context() as mp:
                    if path == "torch":
                        mp.setenv(native.ENV, "0")
                    logits = run()
            finally:
                handle.remove()
            if path == "compiled":
                assert torch.equal(logits, plain)
    names = {id(m): n for n, m in micro_exact.named_modules()}
    differ = {names.get(k, k): (counts["compiled"].get(k), counts["torch"].get(k)) for k in counts["torch"]}
    differ = {n: c for n, c in differ.items() if c[0] != c[1]}
    assert not differ, differ
    projections = ("attn.wq_a", "attn.wkv", "attn.wo_b", "attn.indexer.wk", "attn.indexer.wq_b", "attn_norm")
    for name in projections:
        assert any(names[k].endswith(name) and n > 0 for k, n in counts["compiled"].items() if k in names), (
            name
        )


def test_a_subclassed_projection_runs_its_own_forward_on_decode_steps() -> None:
    """A module replaced by a subclass with its own ``forward`` (a wrapper, e.g. LoRA or a probe) runs it on a
    decode step: the compiled paths stand in only for exactly `Linear` / `RMSNorm`. Here the wrappers of one
    layer's ``wq_a`` and ``kv_norm`` count their calls and change nothing, so the logits are unchanged."""
    from kvdiet.formats import native
    from kvdiet.model.layers import RMSNorm
    from kvdiet.model.linear import Linear

    assert native.fp4_kernels() is not None, "the compiled kernels did not build"
    calls: list[str] = []

    class CountedLinear(Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append("wq_a")
            return super().forward(x)

    class CountedNorm(RMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append("kv_norm")
            return super().forward(x)

    model = Transformer.from_config(load_config("v4.1-micro"), seed=0, exact=True)

    def steps() -> torch.Tensor:
        state = model.new_state()
        model.prefill(state, _tokens(20))
        return torch.cat([model.decode([state], [t]) for t in (3, 8)])

    with torch.no_grad():
        plain = steps()
        attn = model.layers[3].attn
        for name, cls in (("wq_a", CountedLinear), ("kv_norm", CountedNorm)):
            module = attn._modules[name]
            module.__class__ = cls  # the same weights, the subclass's forward
        calls.clear()
        state = model.new_state()
        model.prefill(state, _tokens(20))
        prefill_calls = len(calls)
        wrapped = torch.cat([model.decode([state], [t]) for t in (3, 8)])
    assert calls[prefill_calls:] == ["wq_a", "kv_norm"] * 2, calls
    assert torch.equal(wrapped, plain)


def test_a_gathered_pair_no_later_layer_reads_lends_its_buffer_to_the_next(monkeypatch) -> None:
    """In a decode step each (KV source, index source) pair's selected entries are gathered once; once no later
    layer reads a pair (`last_reads`), the next pair's fused gather writes into its buffer. The logits are those
    of a step that allocates every gather anew (bit for bit), and with one buffer lent the reads still name each
    pair's own entries (the pairs' entries differ)."""
    from kvdiet.model import decode_step
    from kvdiet.model.batch_tables import BatchTables

    m = Transformer.from_config(load_config("v4.1-micro"), seed=0)
    pairs = decode_step.last_reads(m.plan)
    assert len(pairs) >= 2
    seen: list[tuple[int, int | None, int]] = []  # (layer, the buffer lent, the result's buffer)
    gather = BatchTables.gather

    def spy(self, layer, idx, counts, codec, pending, out=None):
        got = gather(self, layer, idx, counts, codec, pending, out)
        seen.append((layer, None if out is None else out.data_ptr(), got.data_ptr()))
        return got

    monkeypatch.setattr(BatchTables, "gather", spy)
    state, fresh = m.new_state(), m.new_state()
    m.prefill(state, _tokens(60, seed=3))
    m.prefill(fresh, _tokens(60, seed=3))
    got = m.decode([state], [5])
    assert len(seen) == len(pairs) and seen[0][1] is None
    lent = [(out, result) for _layer, out, result in seen[1:]]
    assert all(out == result for out, result in lent)  # each later pair in the buffer lent to it
    assert {out for out, _ in lent} <= {result for _l, _o, result in seen}
    monkeypatch.setattr(decode_step, "last_reads", lambda _plan: {})  # nothing lent: every gather its own
    seen.clear()
    assert torch.equal(got, m.decode([fresh], [5])) and all(out is None for _l, out, _r in seen)
