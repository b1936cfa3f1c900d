"""Host reads of a decode step on the pure-torch path (the one CUDA runs, where each read of a tensor value waits
for the device), and the value checks that wait for one read: `PendingCheck` in the FP8, FP4 and MXFP4 codecs, in
`Codec.read_window`, in the index scores, and in a decode step (`DecodePlan.check_pending`), each raising the
error the immediate check raises, before any ring or pool is written."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvdiet.config import load_config
from kvdiet.formats import fp4, fp8, mxfp4, native
from kvdiet.formats.codec import CacheCodecs
from kvdiet.formats.scales import PendingCheck, run_checks
from kvdiet.model.index_scores import StoredKeys, index_scores_each
from kvdiet.model.transformer import Transformer

_READS = (
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.tolist,
    torch.Tensor.nonzero,
    torch.nonzero,
)
HOST_READS = 28
"""Host reads of the counted v4.1-micro step below (92 when each window read checked its slots and values at
once: 36 of them inside `Codec.read_window`; 58 when the index queries, the index keys scored, the main-KV
entries gathered and the compressors' entries were checked at once: 26 of them in `block_amax` and
`check_scale_bytes`, 6 in `index_scores`, 1 in `select_candidate_blocks`)."""


class _CountReads(TorchFunctionMode):
    """Counts host reads of tensor values, by the innermost kvdiet function making them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/kvdiet/" in f.filename]
            self.sites[frames[-1].name if frames else "?"] += 1
            if any(f.name == "read_window" for f in frames):
                self.sites["inside read_window"] += 1
        return func(*args, **(kwargs or {}))


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def micro(monkeypatch) -> Transformer:
    """v4.1-micro (9 layers, window 8, FP8 window entries) on the pure-torch path."""
    monkeypatch.setenv(native.ENV, "0")
    return Transformer.from_config(load_config("v4.1-micro"), seed=0)


@pytest.fixture(params=[None, "0"], ids=["compiled", "pure"])
def micro_both(request, monkeypatch) -> Transformer:
    """v4.1-micro on either path (the compiled window read declines a failing value to the torch path)."""
    if request.param:
        monkeypatch.setenv(native.ENV, request.param)
    return Transformer.from_config(load_config("v4.1-micro"), seed=0)


def _states(m: Transformer, lengths=(13, 30)):
    states = [m.new_state() for _ in lengths]
    for s, n in zip(states, lengths, strict=True):
        m.prefill(s, _tokens(n, n))
    return states


def test_a_torch_decode_step_reads_the_host_a_bounded_number_of_times(micro: Transformer) -> None:
    """Two requests, one step: no host read inside the window reads (slots in range by construction, value
    checks read once per batch of layers), none to check values or size the index scores, at most `HOST_READS`
    in all."""
    states = _states(micro)
    micro.decode(states, [5, 6])
    count = _CountReads()
    with count, torch.no_grad():
        micro.decode(states, [7, 8])
    assert count.sites["inside read_window"] == 0, count.sites
    # the checks are read at the compressors of layers 1, 3 and 5 (before their tails change, and before they
    # write entries) and before the rings are written
    assert count.sites["run_checks"] == 7, count.sites
    deferred = {"block_amax", "check_scale_bytes", "index_scores", "select_candidate_blocks", "_gather_main"}
    assert not deferred & set(count.sites), count.sites
    assert sum(n for site, n in count.sites.items() if site != "inside read_window") <= HOST_READS, (
        count.sites
    )


@pytest.mark.parametrize("env", [None, "0"], ids=["compiled", "pure"])
def test_fp8_pending_checks_raise_the_immediate_errors_and_keep_valid_bits(monkeypatch, env) -> None:
    """With ``pending``, FP8 encode and decode read nothing: valid input gives the same bits, a failing value
    becomes finite bytes or values, and the check raises the immediate error (the compiled kernels check as
    they go: a failing input falls back to the torch path)."""
    if env:
        monkeypatch.setenv(native.ENV, env)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen) * torch.tensor([0.0, 1e-30, 1.0, 1e37, 7.0])[:, None]
    checks: list = []
    assert torch.equal(fp8.encode_window(x, pending=checks), fp8.encode_window(x))
    packed = fp8.encode_window(x)
    assert torch.equal(
        fp8.decode_window(packed, pending=checks).view(torch.int32),
        fp8.decode_window(packed).view(torch.int32),
    )
    run_checks(checks)  # nothing failed
    assert len(checks) == (2 if env else 0) and not any(bool(c.failed) for c in checks)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[3, 40] = bad
        checks = []
        out = fp8.encode_window(y, pending=checks)
        assert torch.equal(out[[0, 1, 2, 4]], packed[[0, 1, 2, 4]])
        assert torch.isfinite(fp8.decode_window(out)).all()
        with pytest.raises(ValueError, match=r"^mxfp8: input holds a non-finite .* in row 3$"):
            fp8.encode_window(y)
        with pytest.raises(ValueError, match=r"^mxfp8: input holds a non-finite .* in row 3$"):
            run_checks(checks)
    for byte in (0, 104, 247, 255):
        corrupt = packed.clone()
        corrupt[2, 64] = byte
        checks = []
        values = fp8.decode_window(corrupt, pending=checks)
        assert torch.isfinite(values).all() and torch.equal(
            values[[0, 1, 3, 4]], fp8.decode_window(packed)[[0, 1, 3, 4]]
        )
        want = rf"^mxfp8: stored scale byte {byte} is outside the written range \(105, 246\)$"
        with pytest.raises(ValueError, match=want):
            fp8.decode_window(corrupt)
        with pytest.raises(ValueError, match=want):
            run_checks(checks)


def _window_inputs(batch: int = 3, window: int = 16, dim: int = 512):
    gen = torch.Generator().manual_seed(batch)
    kv = torch.randn(batch, dim, generator=gen)
    rings = [fp8.encode_window(torch.randn(window, dim, generator=gen)) for _ in range(batch)]
    slots = torch.randint(window, (batch, window - 1), generator=gen)
    held = torch.rand(batch, window - 1, generator=gen) < 0.7
    return kv, rings, slots, held


def test_read_window_with_pending_gives_the_same_bits_and_errors(monkeypatch) -> None:
    """`Codec.read_window` with ``pending`` on the torch path: the bits of the checked read, no host read, and
    checks that raise its errors in its order (the new key's, then the rows')."""
    monkeypatch.setenv(native.ENV, "0")
    codec = CacheCodecs.for_dims(512, 128).window
    kv, rings, slots, held = _window_inputs()
    for h in (held, None):
        checks: list = []
        count = _CountReads()
        with count:
            keys, entries = codec.read_window(kv, rings, slots, h, pending=checks)
        assert not count.sites and len(checks) == 2
        want_keys, want_entries = codec.read_window(kv, rings, slots, h)
        assert torch.equal(keys.view(torch.int32), want_keys.view(torch.int32)) and torch.equal(
            entries, want_entries
        )
    held[1, 0] = True
    rings[1][slots[1, 0], 512 + 3] = 250  # held row 0 of request 1
    kv[2, 9] = float("nan")
    for bad_kv in (False, True):
        k = kv if bad_kv else kv.nan_to_num(0.0)
        want = (
            r"^mxfp8: input holds a non-finite .* in row 2$" if bad_kv else r"^mxfp8: stored scale byte 250 "
        )
        with pytest.raises(ValueError, match=want):
            codec.read_window(k, rings, slots, held)
        checks = []
        keys, _ = codec.read_window(k, rings, slots, held, pending=checks)
        assert torch.isfinite(keys).all()
        with pytest.raises(ValueError, match=want):
            run_checks(checks)


def _rings_of(states):
    rings = [s.windows.rows.clone() for s in states], [s.windows.positions.clone() for s in states]
    tails = [{layer: (t.count, t.kv.clone()) for layer, t in s.tails.items()} for s in states]
    return rings, tails


def _assert_untouched(states, before, tokens, *, failed_layer: int) -> None:
    """No ring written, no position moved on, and no compressor tail past the failing layer changed (the state
    the immediate check left: its layer's compressor runs before its window read)."""
    (rows, positions), tails = before
    for s, r, p, n, tail in zip(states, rows, positions, tokens, tails, strict=True):
        assert torch.equal(s.windows.rows, r) and torch.equal(s.windows.positions, p) and s.num_tokens == n
        later = [layer for layer in tail if layer > failed_layer]
        assert all(
            s.tails[layer].count == tail[layer][0] and torch.equal(s.tails[layer].kv, tail[layer][1])
            for layer in later
        )


def test_a_decode_step_raises_a_corrupt_ring_rows_error_before_writing_the_rings(
    micro_both: Transformer,
) -> None:
    """A held ring row of layer 6 with a scale byte out of range: the step raises the window read's error (after
    the later layers ran on finite values) and writes no ring."""
    states = _states(micro_both)
    held_slot = (states[1].num_tokens - 2) % micro_both.cfg.sliding_window
    states[1].windows.rows[6, held_slot, 64] = 255
    before, tokens = _rings_of(states), [s.num_tokens for s in states]
    with pytest.raises(ValueError, match=r"^mxfp8: stored scale byte 255 is outside the written range"):
        micro_both.decode(states, [5, 6])
    _assert_untouched(states, before, tokens, failed_layer=6)


def test_a_decode_step_raises_a_non_finite_window_key_before_a_later_compressor_sees_it(
    micro_both: Transformer, monkeypatch
) -> None:
    """A non-finite new window key of layer 2 (a NaN weight of its ``wkv``) and non-finite input to layer 5's
    compressor (which encodes every step): the step raises the window's error, as the immediate check did,
    and writes no ring."""
    m = micro_both
    states = _states(m)
    comp5 = m.layers[5].attn.compressor
    with torch.no_grad():
        m.layers[2].attn.wkv.weight[3] = float("nan")
    nan = torch.full((2, m.cfg.head_dim), float("nan"))
    monkeypatch.setattr(comp5.wkv, "forward", lambda x: nan[: x.shape[0]])
    before, tokens = _rings_of(states), [s.num_tokens for s in states]
    with pytest.raises(ValueError, match=r"^mxfp8: input holds a non-finite .* in row 0$"):
        m.decode(states, [5, 6])
    assert [layer for layer in before[1][0] if layer > 2] == [3]  # a tail that must stay as it was
    _assert_untouched(states, before, tokens, failed_layer=2)
    # layer 5's compressor alone (a fresh model: the failed step left layer 1's tails advanced): its own error
    m = Transformer.from_config(load_config("v4.1-micro"), seed=0)
    states = _states(m)
    with torch.no_grad():
        m.layers[5].attn.compressor.wkv.weight[0] = float("nan")
    with pytest.raises(ValueError, match=r"^(fp4|mxfp4)\S*: input holds a non-finite"):
        m.decode(states, [5, 6])


def test_a_failing_window_raises_before_a_later_indexer_checks_its_queries(micro_both: Transformer) -> None:
    """A NaN weight in layer 6's window projection: its attention output, and so layer 7's index queries, turn
    non-finite; the window's own error comes first (the checks are read before the queries' round trip), as it
    did when the window read checked at once."""
    m = micro_both
    states = _states(m)
    with torch.no_grad():
        m.layers[6].attn.wkv.weight[0] = float("nan")
    before, tokens = _rings_of(states), [s.num_tokens for s in states]
    with pytest.raises(ValueError, match=r"^mxfp8: input holds a non-finite .* in row 0$"):
        m.decode(states, [5, 6])
    _assert_untouched(states, before, tokens, failed_layer=6)


def test_a_decode_plan_refuses_rings_of_another_shape(micro: Transformer) -> None:
    """The window slots are in range only when every request's rings have the first one's shape: checked on the
    host, naming the request, before anything is read."""
    from kvdiet.model.attention import Segment
    from kvdiet.model.decode_step import DecodePlan
    from kvdiet.model.state import WindowRings

    states = _states(micro, (5, 9, 12))
    states[2].windows = WindowRings(micro.codecs.window, micro.cfg.sliding_window // 2, len(micro.layers))
    segs = [Segment(s, torch.tensor([s.num_tokens])) for s in states]
    with pytest.raises(
        ValueError,
        match=r"^request 2's window rings are \[9, 4, 66\] in 9 layer views, request 0's \[9, 8, 66\]$",
    ):
        DecodePlan.for_segments(segs)


_FP4_CODECS = [
    (fp4.encode_main_kv, fp4.decode_main_kv, "fp4_e2m1_e4m3x16", 64, (1, 126), (0, 127, 255)),
    (mxfp4.encode_index_key, mxfp4.decode_index_key, "mxfp4", 32, (1, 252), (0, 253, 255)),
]


@pytest.mark.parametrize("env", [None, "0"], ids=["compiled", "pure"])
@pytest.mark.parametrize(
    ("encode", "decode", "name", "dim", "valid", "bad_bytes"), _FP4_CODECS, ids=["fp4", "mxfp4"]
)
def test_fp4_pending_checks_raise_the_immediate_errors_and_keep_valid_bits(
    monkeypatch, env, encode, decode, name, dim, valid, bad_bytes
) -> None:
    """FP4 main-KV and MXFP4 index-key encode and decode with ``pending``: valid input gives the same bits with no
    host read on the torch path, a failing value becomes bytes in the written ranges (finite values) with the
    other rows' bytes unchanged, and the check raises the immediate error (a compiled kernel that finds a failing
    value hands the rows to the torch path)."""
    if env:
        monkeypatch.setenv(native.ENV, env)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, dim, generator=gen) * torch.tensor([0.0, 1e-30, 1.0, 1e37, 7.0])[:, None]
    packed = encode(x)
    checks: list = []
    count = _CountReads()
    with count:
        assert torch.equal(encode(x, pending=checks), packed)
        values = decode(packed, pending=checks)
    assert torch.equal(values.view(torch.int32), decode(packed).view(torch.int32))
    assert not count.sites if env else len(checks) == 0
    run_checks(checks)  # nothing failed
    assert len(checks) == (2 if env else 0) and not any(bool(c.failed) for c in checks)
    scale_at = packed.shape[1] - dim // (16 if name.startswith("fp4") else 32)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[3, dim // 2 + 1] = bad
        checks = []
        out = encode(y, pending=checks)
        assert torch.equal(out[[0, 1, 2, 4]], packed[[0, 1, 2, 4]])
        assert ((out[:, scale_at:] >= valid[0]) & (out[:, scale_at:] <= valid[1])).all()
        assert torch.isfinite(decode(out)).all()
        want = rf"^{name}: input holds a non-finite .* in row 3$"
        with pytest.raises(ValueError, match=want):
            encode(y)
        with pytest.raises(ValueError, match=want):
            run_checks(checks)
    for byte in bad_bytes:
        corrupt = packed.clone()
        corrupt[2, scale_at] = byte
        checks = []
        values = decode(corrupt, pending=checks)
        assert torch.isfinite(values).all() and torch.equal(
            values[[0, 1, 3, 4]], decode(packed)[[0, 1, 3, 4]]
        )
        # the byte read clamped into the range: the values of the entry holding the range's nearest end
        clamped = corrupt.clone()
        clamped[2, scale_at] = min(max(byte, valid[0]), valid[1])
        assert torch.equal(values[2], decode(clamped)[2])
        want = rf"^{name}: stored scale byte {byte} is outside the written range \({valid[0]}, {valid[1]}\)$"
        with pytest.raises(ValueError, match=want):
            decode(corrupt)
        with pytest.raises(ValueError, match=want):
            run_checks(checks)


def _index_case():
    gen = torch.Generator().manual_seed(5)
    q = mxfp4.decode_index_key(mxfp4.encode_index_key(torch.randn(2, 2, 64, generator=gen)))
    w = torch.rand(2, 2, generator=gen)
    keys = [StoredKeys.contiguous(mxfp4.encode_index_key(torch.randn(n, 64, generator=gen))) for n in (9, 20)]
    return q, w, keys, torch.tensor([7, 20])


def test_index_scores_with_pending_read_nothing_and_raise_the_immediate_error(monkeypatch) -> None:
    """The torch path's scores with ``pending`` and host limits: the same bits, no host read; a visible entry's bad
    scale byte reads clamped (finite scores) and its check raises the immediate error; an entry past the limit
    is not checked."""
    monkeypatch.setenv(native.ENV, "0")
    q, w, keys, limit = _index_case()
    want = index_scores_each(q, w, keys, None, limit)
    checks: list = []
    count = _CountReads()
    with count:
        got = index_scores_each(q, w, keys, None, limit, host_limit=[7, 20], pending=checks)
    assert not count.sites and torch.equal(got.view(torch.int32), want.view(torch.int32))
    run_checks(checks)
    keys[0].rows[8, 32] = 0  # entry 8 of request 0: past its limit 7, never read
    keys[1].rows[4, 32] = (
        252  # entry 4 of request 1 (visible) at the top of the range: its scores when clamped
    )
    at_top = index_scores_each(q, w, keys, None, limit)
    assert torch.equal(at_top[0].view(torch.int32), want[0].view(torch.int32))
    keys[1].rows[4, 32] = 255
    msg = r"^mxfp4: stored scale byte 255 is outside the written range \(1, 252\)$"
    with pytest.raises(ValueError, match=msg):
        index_scores_each(q, w, keys, None, limit)
    checks = []
    got = index_scores_each(q, w, keys, None, limit, host_limit=[7, 20], pending=checks)
    assert not torch.isnan(got).any() and torch.equal(got.view(torch.int32), at_top.view(torch.int32))
    assert torch.equal(got[1, :4], want[1, :4]) and torch.equal(got[1, 5:], want[1, 5:])
    with pytest.raises(ValueError, match=msg):
        run_checks(checks)


def test_index_scores_on_the_compiled_path_raise_after_the_earlier_pending_checks(monkeypatch) -> None:
    """The compiled kernel checks as it scores and raises its own error at once, after ``pending``'s checks: an
    earlier failed check's error comes first, as the immediate checks would order them."""
    monkeypatch.delenv(native.ENV, raising=False)
    assert native.fp4_kernels() is not None, "the compiled kernels did not build"
    q, w, keys, limit = _index_case()
    keys[1].rows[4, 32] = 0
    with pytest.raises(ValueError, match=r"^index key entry 4 holds a scale byte outside 1\.\.252$"):
        index_scores_each(q, w, keys, None, limit, pending=[])
    earlier = PendingCheck(torch.tensor(True), lambda: ValueError("earlier"))
    with pytest.raises(ValueError, match=r"^earlier$"):
        index_scores_each(q, w, keys, None, limit, pending=[earlier])


def _pools_of(states):
    pages = [{k: t.clone() for k, t in s.table.pool.pages().items()} for s in states]
    return pages, [
        {layer: (len(s.main[layer]), len(s.index_keys[layer])) for layer in s.main} for s in states
    ]


def _assert_pools_untouched(states, before, layers) -> None:
    """The pages and the stores' lengths of KV-source ``layers`` are as ``before`` (`_pools_of`)."""
    pages, lengths = before
    for s, p, n in zip(states, pages, lengths, strict=True):
        for layer in layers:
            assert (len(s.main[layer]), len(s.index_keys[layer])) == n[layer], layer
        for (layer, kind), t in s.table.pool.pages().items():
            if layer in layers:
                assert torch.equal(t, p[(layer, kind)]), (layer, kind)


def _stored_rows(store) -> torch.Tensor:
    """The pool rows (int64 [N]) of one store's entries."""
    keys = StoredKeys.of(store)
    ids = torch.arange(keys.num_entries)
    return keys.table[ids // keys.per_block] * keys.per_block + ids % keys.per_block


@pytest.mark.parametrize("kind", ["index", "main"])
def test_a_decode_step_raises_a_corrupt_stored_entry_before_a_later_layer_writes(
    micro_both: Transformer, kind
):
    """A scale byte out of range in request 1's index keys (scored by layers 3 and 4) or main-KV entries (gathered
    by them) of layer 3: the step raises the immediate error at the next check (layer 5's compressor) and writes
    neither layer 5's entries nor any ring."""
    m = micro_both
    states = _states(m)
    store = states[1].index_keys[3] if kind == "index" else states[1].main[3]
    rows = store.table.pool.rows(3, kind)
    scale_at = 16 if kind == "index" else 32  # the first scale byte (index head dim 32, head dim 64)
    rows[_stored_rows(store), scale_at] = 0
    before, rings, tokens = _pools_of(states), _rings_of(states), [s.num_tokens for s in states]
    if kind == "main":
        msg = r"^fp4_e2m1_e4m3x16: stored scale byte 0 is outside the written range \(1, 126\)$"
    elif native.fp4_kernels() is not None:
        msg = r"^index key entry \d+ holds a scale byte outside 1\.\.252$"
    else:
        msg = r"^mxfp4: stored scale byte 0 is outside the written range \(1, 252\)$"
    with pytest.raises(ValueError, match=msg):
        m.decode(states, [5, 6])
    _assert_untouched(states, rings, tokens, failed_layer=4)  # layer 4 read the entries last
    _assert_pools_untouched(states, before, (5,))


def test_a_compressors_non_finite_entry_raises_before_any_of_its_entries_is_written(micro_both: Transformer):
    """Layer 3's compressor encodes a NaN row: its index keys' and main entries' checks are read once, before
    either is written, raising the immediate error (the index keys' first)."""
    m = micro_both
    states = _states(m, (13, 29))  # both requests close a group of 2 in this step
    with torch.no_grad():
        m.layers[3].attn.compressor.wkv.weight[0] = float("nan")
    before = _pools_of(states)
    with pytest.raises(ValueError, match=r"^mxfp4: input holds a non-finite .* in row 0$"):
        m.decode(states, [5, 6])
    _assert_pools_untouched(states, before, (3, 5))


def test_a_selection_observer_sees_no_top_k_of_a_failing_check(micro_both: Transformer) -> None:
    """Layer 3's observer: with request 1's layer-3 index keys corrupt, the step raises the immediate error before
    the observer is called (the pending checks are read first); with them intact it sees both requests."""
    m = micro_both
    states = _states(m)
    seen: list = []
    m.layers[3].attn.selection_observer = seen.append
    m.decode(states, [5, 6])
    assert [s.seg.state for s in seen] == states
    seen.clear()
    store = states[1].index_keys[3]
    store.table.pool.rows(3, "index")[_stored_rows(store), 16] = 0
    with pytest.raises(ValueError, match="scale byte"):
        m.decode(states, [7, 8])
    assert seen == []
