"""A decode step's attention in one call (`kvdiet.model.decode_attend`): the compiled kernel and the pure-torch
path bit for bit on adversarial inputs, both in the documented order (written out below), within fp32 rounding
of ``attend``; routing, refusals, and the decode step calling it."""

from __future__ import annotations

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.model import decode_step
from kvdiet.model.attention import attend
from kvdiet.model.decode_attend import decode_attend
from kvdiet.model.gemv import row_products
from kvdiet.model.transformer import Transformer

_SPECIALS = (0.0, -0.0, 1e-45, -3e-39, 1e-38, -1e-30, 3e15, -3e15)


def _values(shape: tuple[int, ...], gen: torch.Generator, *, octaves: int, specials: bool) -> torch.Tensor:
    """fp32 normal values over ``2^-octaves .. 2^octaves``; with ``specials``, every tenth one of `_SPECIALS`
    (±0, subnormals, tiny and huge magnitudes)."""
    x = torch.randn(shape, generator=gen) * torch.exp2(
        torch.randint(-octaves, octaves + 1, shape, generator=gen).float()
    )
    if specials:
        chosen = torch.rand(shape, generator=gen) < 0.1
        table = torch.tensor(_SPECIALS)
        x[chosen] = table[torch.randint(len(table), (int(chosen.sum()),), generator=gen)]
    return x


def _inputs(b, h, d, w, k, seed, *, octaves=20, specials=True, masks="random"):
    gen = torch.Generator().manual_seed(seed)
    q = _values((b, h, d), gen, octaves=octaves, specials=specials)
    win = _values((b, w, d), gen, octaves=octaves, specials=specials)
    comp = _values((b, k, d), gen, octaves=octaves, specials=specials) if k else None
    win_mask = torch.rand(b, w, generator=gen) < 0.8
    comp_mask = (torch.rand(b, k, generator=gen) < 0.7) if k else None
    if masks == "one":  # all but one key masked, in a different place per request
        win_mask[:] = False
        if comp_mask is not None:
            comp_mask[:] = False
        for r in range(b):
            j = (r * 7) % (w + k)
            (win_mask[r] if j < w else comp_mask[r])[j if j < w else j - w] = True
    elif masks == "no window":
        win_mask[:] = False
    elif masks == "none":
        win_mask[:] = False
        if comp_mask is not None:
            comp_mask[:] = False
    if w > 1 and k:  # ties: duplicated keys give equal logits
        win[:, 0] = comp[:, -1]
    sink = _values((h,), gen, octaves=2, specials=False)
    return q, win, win_mask, comp, comp_mask, sink, d**-0.5


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and bits (−0.0 told from +0.0); NaN in the same places."""
    nan = a.isnan()
    return (
        a.shape == b.shape
        and torch.equal(nan, b.isnan())
        and torch.equal(a.masked_fill(nan, 0).view(torch.int32), b.masked_fill(nan, 0).view(torch.int32))
    )


# (B, H, D, W, K): every window and selected-entry count 0/1..33 (each vector tail and lane split), then decode
# sizes; D in 16, 48, 64, 512 and 37 (no whole vector at its end)
_SHAPES = [
    ((1, 3, 16)[i % 3], (1, 4, 5)[i % 3 - 1], (16, 48, 64, 512, 37)[i % 5], w, (w * 7) % 34)
    for i, w in enumerate(range(1, 34))
] + [
    (1, 4, 512, 128, 512),
    (16, 4, 512, 128, 512),
    (3, 5, 37, 128, 0),
    (16, 1, 48, 33, 512),
    (1, 4, 64, 0, 17),
]


@pytest.mark.parametrize(("b", "h", "d", "w", "k"), _SHAPES)
def test_compiled_equals_pure_torch_on_adversarial_values(both, b, h, d, w, k):
    args = _inputs(b, h, d, w, k, seed=b * 100000 + h * 10000 + d * 100 + w + k)
    compiled, pure = both(decode_attend, *args)
    assert compiled.shape == (b, h, d) and compiled.dtype == torch.float32
    assert _same_bits(compiled, pure)


@pytest.mark.parametrize(("b", "h", "d", "w", "k"), [s for s in _SHAPES if s[4]] + [(2, 4, 37, 40, 70)])
def test_bf16_entries_read_as_their_fp32_values(both, b, h, d, w, k):
    """Selected entries in bf16 (the compiled gather's, ``fp4.gather_main_kv``) give the bits of the same values in
    fp32, on both paths: every D's vector tail, row and lane tasks (with a tail: D = 37 over 110 keys), windows of
    0..128 keys."""
    for mild in (False, True):  # adversarial values; values whose entries all weigh in
        q, win, win_mask, comp, comp_mask, sink, scale = _inputs(
            b, h, d, w, k, seed=7 * k + w, octaves=1 if mild else 20, specials=not mild
        )
        short = comp.bfloat16()
        want = decode_attend(q, win, win_mask, short.float(), comp_mask, sink, scale)
        compiled, pure = both(decode_attend, q, win, win_mask, short, comp_mask, sink, scale)
        assert _same_bits(compiled, want) and _same_bits(pure, want)
        if mild and bool(comp_mask.any()):  # the entries' rounding shows: they were read
            assert not _same_bits(want, decode_attend(q, win, win_mask, comp, comp_mask, sink, scale))


def check_bf16_entries() -> None:
    """bf16 entries in the compiled kernel against their fp32 values on the pure-torch path, at a decode size and a
    D with a vector tail; run in the AVX2 and scalar builds too (``test_formats_native``'s build test)."""
    from kvdiet.formats import native

    for b, h, d, w, k in ((1, 4, 512, 128, 512), (3, 5, 37, 9, 20)):
        q, win, win_mask, comp, comp_mask, sink, scale = _inputs(
            b, h, d, w, k, seed=k, octaves=1, specials=False
        )
        got = decode_attend(q, win, win_mask, comp.bfloat16(), comp_mask, sink, scale)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(native.ENV, "0")
            want = decode_attend(q, win, win_mask, comp.bfloat16().float(), comp_mask, sink, scale)
        assert _same_bits(got, want)


@pytest.mark.parametrize("masks", ["one", "no window", "none"])
@pytest.mark.parametrize(
    ("b", "h", "d", "w", "k"), [(3, 4, 48, 17, 33), (1, 5, 512, 128, 512), (16, 1, 37, 5, 0)]
)
def test_masks_compiled_equals_pure_torch_and_attend(both, b, h, d, w, k, masks):
    if masks == "no window" and not k:
        masks = "none"
    args = _inputs(b, h, d, w, k, seed=w + k, masks=masks)
    compiled, pure = both(decode_attend, *args)
    assert _same_bits(compiled, pure)
    bounded = _inputs(b, h, d, w, k, seed=w + k, octaves=2, specials=False, masks=masks)
    _assert_near_attend(decode_attend(*bounded), bounded)
    if masks == "none":  # only the sink: zero weight on every key
        assert torch.equal(decode_attend(*bounded), torch.zeros(b, h, d))


def _assert_near_attend(got: torch.Tensor, args) -> None:
    """Within fp32 rounding of ``attend`` (its BLAS order) on the same inputs: the sums' rounding, relative to
    the largest value a row reads."""
    want = attend(*args)
    values = [torch.zeros(1), args[1].flatten()] + ([] if args[3] is None else [args[3].flatten()])
    scale = float(torch.cat(values).abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize(("b", "h", "d", "w", "k"), _SHAPES[::4] + _SHAPES[-5:])
def test_agrees_with_attend_within_fp32_rounding(both, b, h, d, w, k):
    """Logits of a few units (a logit's rounding moves a probability by as much): values over 2^-20..2^2 with
    ±0, subnormals and tiny values, and ties."""
    gen = torch.Generator().manual_seed(w * 31 + k)
    args = list(_inputs(b, h, d, w, k, seed=w * 31 + k, octaves=2, specials=False))
    args[1] = args[1] * torch.exp2(-torch.randint(0, 22, args[1].shape, generator=gen).float())
    args[1][..., ::7] = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 1e-38])[
        torch.arange(args[1][..., ::7].numel()) % 5
    ].view(args[1][..., ::7].shape)
    compiled, pure = both(decode_attend, *args)
    assert _same_bits(compiled, pure)
    _assert_near_attend(compiled, args)


def test_non_finite_values_compiled_equals_pure_torch(both):
    """inf and NaN in a key, the queries and the sink: the same outputs, NaN in the same places."""
    q, win, win_mask, comp, comp_mask, sink, scale = _inputs(
        3, 4, 48, 9, 21, seed=5, octaves=4, specials=False
    )
    win[0, 2, 5] = float("inf")
    comp[1, 3, 0] = float("nan")
    q[2, 1, 7] = float("-inf")
    sink[3] = float("inf")
    compiled, pure = both(decode_attend, q, win, win_mask, comp, comp_mask, sink, scale)
    assert compiled.isnan().any() and not compiled.isnan().all()
    assert _same_bits(compiled, pure)


def _written_out(q, win, win_mask, comp, comp_mask, sink, scale) -> torch.Tensor:
    """The documented order as Python-level fp32 steps, one output at a time."""
    keys, mask = torch.cat([win, comp], 1), torch.cat([win_mask, comp_mask], 1)
    b, h, d = q.shape
    n = keys.shape[1]
    out = torch.empty(b, h, d)
    for r in range(b):
        for g in range(h):
            logits = torch.empty(n + 1)
            for j in range(n):
                logits[j] = _lane_sum(q[r, g], keys[r, j]) * torch.tensor(scale, dtype=torch.float32)
                if not mask[r, j]:
                    logits[j] = float("-inf")
            logits[n] = sink[g]
            p = torch.softmax(logits[None, None], -1)[0, 0, :n]
            for e in range(d):
                out[r, g, e] = _lane_sum(p, keys[r, :, e])
    return out


def _lane_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ x[i]·y[i]: 16 lanes (lane l: i = l, l + 16, … from +0, each product rounded), then the fold."""
    lanes = torch.zeros(16)
    for start in range(0, x.shape[0], 16):
        stop = min(x.shape[0], start + 16)
        prod = torch.zeros(16)
        prod[: stop - start] = x[start:stop] * y[start:stop]
        lanes = lanes + prod
    s8 = lanes[:8] + lanes[8:]
    s4 = s8[:4] + s8[4:]
    s2 = s4[:2] + s4[2:]
    return s2[0] + s2[1]


def test_the_order_is_the_documented_one(both):
    """Both paths equal the order written out step by step, and the check can fail: attend's BLAS order and a
    plain sequential sum of the values round differently on these inputs."""
    args = list(_inputs(2, 2, 37, 11, 30, seed=9, octaves=12, specials=False))
    args[0] = (
        torch.randn(2, 2, 37, generator=torch.Generator().manual_seed(1)) * 2**-14
    )  # spread probabilities
    compiled, pure = both(decode_attend, *args)
    written = _written_out(*args)
    assert _same_bits(compiled, written) and _same_bits(pure, written)
    q, win, win_mask, comp, comp_mask, sink, scale = args
    keys = torch.cat([win, comp], 1)
    logits = torch.stack([row_products(q[r], keys[r]) for r in range(2)]) * torch.tensor(scale)
    logits = logits.masked_fill(~torch.cat([win_mask, comp_mask], 1)[:, None], float("-inf"))
    p = torch.softmax(torch.cat([logits, sink[None, :, None].expand(2, 2, 1)], -1), -1)[..., :41]
    sequential = torch.zeros(2, 2, 37)
    for j in range(41):
        sequential = sequential + p[..., j : j + 1] * keys[:, None, j]
    assert not torch.equal(compiled, sequential)
    assert not torch.equal(compiled, attend(*args))


@pytest.mark.parametrize("k", [40, 60])
def test_threads_and_layouts_give_the_same_bits(k):
    """One, two or three threads (three split two requests' tasks unevenly: 32 lane tasks 11/11/10 at 80 keys,
    row tasks at 60), a strided window (a prefill's band view) or a contiguous copy, a lazy negated key (resolved
    by the kernel): the same bits; the shared entries are only read."""
    q, win, win_mask, comp, comp_mask, sink, scale = _inputs(
        2, 4, 64, 20, k, seed=3, octaves=6, specials=True
    )
    kept = comp.clone()
    want = decode_attend(q, win, win_mask, comp, comp_mask, sink, scale)
    threads = torch.get_num_threads()
    for count in (1, 3):
        try:
            torch.set_num_threads(count)
            other = decode_attend(q, win, win_mask, comp, comp_mask, sink, scale)
        finally:
            torch.set_num_threads(threads)
        assert _same_bits(other, want)
    padded = torch.cat([torch.zeros(2, 64), win.reshape(-1, 64)])
    band = padded.as_strided((2, 20, 64), (20 * 64, 64, 1), 2 * 64)  # rows at a batch stride, read in place
    assert _same_bits(
        decode_attend(
            q.transpose(0, 1).contiguous().transpose(0, 1), band, win_mask, comp, comp_mask, sink, scale
        ),
        want,
    )
    negated = torch._neg_view(-comp)
    assert negated.is_neg()
    assert _same_bits(decode_attend(q, win, win_mask, negated, comp_mask, sink, scale), want)
    assert torch.equal(comp, kept)


def test_fp64_grad_and_other_devices_go_to_attend():
    args = list(_inputs(2, 4, 48, 9, 21, seed=4, octaves=2, specials=False))
    wide = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    assert torch.equal(decode_attend(*wide), attend(*wide))  # an fp64 model keeps attend's products and dtype
    short = [*wide[:3], wide[3].bfloat16(), *wide[4:]]  # bf16 entries: read as fp64 values there
    assert torch.equal(decode_attend(*short), attend(*wide[:3], wide[3].bfloat16().double(), *wide[4:]))
    tracked = [a.clone().requires_grad_() if i in (0, 5) else a for i, a in enumerate(args)]
    out = decode_attend(*tracked)
    assert out.grad_fn is not None and torch.equal(out, attend(*tracked))
    with torch.no_grad():  # no gradient to track: the kernel's order
        assert not torch.equal(decode_attend(*tracked), attend(*tracked))


def _bad(**changes):
    args = dict(
        zip(
            ("q", "win_kv", "win_mask", "comp_kv", "comp_mask", "sink", "scale"),
            _inputs(2, 4, 16, 5, 7, seed=0, octaves=2, specials=False),
            strict=True,
        )
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"q": torch.zeros(2, 64)}, r"q \[B, H, D\]"),
        ({"win_kv": torch.zeros(2, 5, 17)}, r"win_kv \[2, W, 16\]"),
        ({"win_kv": torch.zeros(3, 5, 16)}, r"win_kv \[2, W, 16\]"),
        ({"win_mask": torch.ones(2, 6, dtype=torch.bool)}, r"win_mask bool \[2, 5\]"),
        ({"win_mask": torch.ones(2, 5)}, r"win_mask bool \[2, 5\]"),
        ({"comp_mask": None}, "together"),
        ({"comp_kv": None}, "together"),
        ({"comp_kv": torch.zeros(2, 7, 15)}, r"comp_kv \[2, K, 16\]"),
        (
            {"comp_kv": torch.zeros(2, 7, 16, dtype=torch.float64)},
            "comp_kv in q's dtype torch.float32 or bf16",
        ),
        ({"comp_kv": torch.zeros(2, 7, 16, dtype=torch.float16)}, "comp_kv in q's dtype"),
        ({"comp_mask": torch.ones(2, 8, dtype=torch.bool)}, r"comp_mask bool \[2, 7\]"),
        ({"sink": torch.zeros(5)}, r"sink \[4\]"),
        ({"q": torch.zeros(2, 4, 16, dtype=torch.int32)}, "floating"),
        ({"win_kv": torch.zeros(2, 5, 16, dtype=torch.float64)}, "floating"),
        ({"sink": torch.zeros(4, device="meta")}, "one device"),
    ],
)
def test_bad_input_is_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        decode_attend(**_bad(**changes))


def test_the_decode_step_attends_through_decode_attend(monkeypatch):
    """`decode_attention` calls `decode_attend` (prefill keeps `attend`): a spy sees every layer of a step."""
    model = Transformer.from_config(load_config("v4.1-micro"), seed=0)
    state = model.new_state()
    model.prefill(state, torch.arange(1, 40))
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return decode_attend(*args)

    monkeypatch.setattr(decode_step, "decode_attend", spy)
    model.decode([state], [5])
    assert len(calls) == len(model.layers) and all(shape[0] == 1 for shape in calls)


@pytest.mark.parametrize(("b", "h"), [(0, 4), (2, 0)])
def test_no_requests_or_no_heads_give_an_empty_result_on_both_paths(monkeypatch, b, h):
    """B = 0 or H = 0: an empty fp32 [B, H, D] from the kernel and from the pure-torch path alike."""
    q, win = torch.randn(b, h, 32), torch.randn(b, 5, 32)
    args = (q, win, torch.ones(b, 5, dtype=torch.bool), None, None, torch.zeros(h), 0.25)
    compiled = decode_attend(*args)
    monkeypatch.setenv("KVDIET_NATIVE_KERNELS", "0")
    pure = decode_attend(*args)
    assert compiled.shape == pure.shape == (b, h, 32) and compiled.dtype == pure.dtype == torch.float32
