"""RoPE and RMSNorm of the V4.1 reference model (v41-spec §2, §10)."""

from __future__ import annotations

import math

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.model.layers import RMSNorm, Rope


@pytest.fixture(scope="module")
def v41():
    return load_config("deepseek-v4.1-flash")


def _yarn_freqs_scalar(d: int, base: float, factor: float, orig: int, beta_fast: float, beta_slow: float):
    """The YaRN formula with the math module only, one pair at a time."""

    def corr(n: float) -> float:
        return d * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))

    low = min(max(math.floor(corr(beta_fast)), 0), d - 1)
    high = min(max(math.ceil(corr(beta_slow)), 0), d - 1)
    if high == low:
        high += 0.001
    out = []
    for i in range(d // 2):
        f = 1.0 / base ** (2 * i / d)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        smooth = 1 - ramp
        out.append(f / factor * (1 - smooth) + f * smooth)
    return out, low, high


def test_yarn_frequencies_match_scalar_formula_on_real_config(v41):
    rope = Rope.for_layer(v41, 2)
    assert rope.yarn and rope.base == 160000 and rope.rope_dim == 64
    expected, low, high = _yarn_freqs_scalar(64, 160000.0, 16.0, 65536, 32.0, 1.0)
    assert (low, high) == (15, 25)
    assert rope.freqs.dtype == torch.float32 and rope.freqs.shape == (32,)
    for i, e in enumerate(expected):
        assert math.isclose(rope.freqs[i].item(), e, rel_tol=2e-6), i
    # fast pairs keep the base frequency, slow pairs are divided by the factor
    assert math.isclose(rope.freqs[3].item(), 160000.0 ** (-6 / 64), rel_tol=2e-6)
    assert math.isclose(rope.freqs[30].item(), 160000.0 ** (-60 / 64) / 16, rel_tol=2e-6)
    assert Rope.for_layer(v41, 1).freqs.equal(rope.freqs)  # same table for ratio 1 and 2


def test_ratio_zero_layers_have_no_yarn(v41):
    rope = Rope.for_layer(v41, 0)
    assert not rope.yarn and rope.base == 10000
    for i in range(32):
        assert math.isclose(rope.freqs[i].item(), 10000.0 ** (-2 * i / 64), rel_tol=2e-6)


def test_no_yarn_when_context_does_not_exceed_original(v41):
    short = v41.replace(max_position_embeddings=65536)
    rope = Rope.for_layer(short, 2)
    assert not rope.yarn
    assert math.isclose(rope.freqs[31].item(), 160000.0 ** (-62 / 64), rel_tol=2e-6)


def test_micro_config_yarn_low_is_clamped():
    micro = load_config("v4.1-micro")
    rope = Rope.for_layer(micro, 1)
    expected, low, high = _yarn_freqs_scalar(16, 160000.0, 4.0, 64, 32.0, 1.0)
    assert (low, high) == (0, 2)  # corr(32) < 0 is clamped to 0
    assert rope.yarn
    torch.testing.assert_close(rope.freqs, torch.tensor(expected, dtype=torch.float32), rtol=2e-6, atol=0)


def test_pairs_are_adjacent_and_values_hand_computed(v41):
    rope = Rope.for_layer(v41, 0)
    d, width = 64, 512
    x = torch.zeros(1, width)
    x[0, width - d + 2] = 1.0  # first element of pair 1
    pos = torch.tensor([7])
    out = rope.rotate(x, pos)
    angle = 7 * 10000.0 ** (-2 / 64)
    moved = (out != 0).nonzero()[:, 1].tolist()
    assert moved == [width - d + 2, width - d + 3]
    assert math.isclose(out[0, width - d + 2].item(), math.cos(angle), abs_tol=1e-6)
    assert math.isclose(out[0, width - d + 3].item(), math.sin(angle), abs_tol=1e-6)
    y = torch.zeros(1, width)
    y[0, width - d + 3] = 1.0  # second element of pair 1
    out = rope.rotate(y, pos)
    assert (out != 0).nonzero()[:, 1].tolist() == [width - d + 2, width - d + 3]
    assert math.isclose(out[0, width - d + 2].item(), -math.sin(angle), abs_tol=1e-6)
    assert math.isclose(out[0, width - d + 3].item(), math.cos(angle), abs_tol=1e-6)


def test_nope_dims_untouched_and_input_not_modified(v41):
    rope = Rope.for_layer(v41, 2)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    out = rope.rotate(x, torch.arange(5) * 1000)
    assert x.equal(before)
    assert out[:, :448].equal(x[:, :448])
    assert not out[1:, 448:].equal(x[1:, 448:])
    assert out[0].equal(x[0])  # position 0 is the identity


def test_inverse_undoes_rotate_at_large_positions(v41):
    rope = Rope.for_layer(v41, 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, 512, generator=g)
    pos = torch.tensor([0, 1, 127, 65536, 500_000, 1_048_575])
    back = rope.rotate(rope.rotate(x, pos), pos, inverse=True)
    torch.testing.assert_close(back, x, atol=2e-5, rtol=0)


def test_relative_position_property(v41):
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
    for ratio in (0, 2):
        rope = Rope.for_layer(v41, ratio)

        def score(m: int, n: int, rope=rope) -> float:
            return (rope.rotate(q, torch.tensor([m])) * rope.rotate(k, torch.tensor([n]))).sum().item()

        ref = score(9, 2)
        for m, n in [(7, 0), (107, 100), (4007, 4000)]:
            assert math.isclose(score(m, n), ref, rel_tol=1e-4, abs_tol=1e-4)
        assert not math.isclose(score(8, 2), ref, rel_tol=1e-3)


def test_positions_broadcast_over_heads(v41):
    rope = Rope.for_layer(v41, 2)
    x = torch.randn(4, 3, 512, generator=torch.Generator().manual_seed(3))  # [T, H, D]
    pos = torch.tensor([3, 50, 9000, 1_000_000])
    out = rope.rotate(x, pos[:, None])
    for h in range(3):
        torch.testing.assert_close(out[:, h], rope.rotate(x[:, h], pos), atol=0, rtol=0)


def test_rotate_keeps_dtype_and_rejects_narrow_input(v41):
    rope = Rope.for_layer(v41, 0)
    assert rope.rotate(torch.ones(2, 64, dtype=torch.bfloat16), torch.arange(2)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="rope_dim"):
        rope.rotate(torch.ones(2, 32), torch.arange(2))


def test_rmsnorm_fp32_formula():
    norm = RMSNorm(4, 1e-20)
    assert norm.weight.equal(torch.ones(4))
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, 1.0]))
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.float32
    r = 1 / math.sqrt((1 + 4 + 9 + 16) / 4)
    torch.testing.assert_close(y, torch.tensor([[r, -4 * r, 1.5 * r, 4 * r]]), rtol=1e-6, atol=0)
    assert norm(torch.zeros(1, 4)).equal(torch.zeros(1, 4))  # eps 1e-20 keeps zeros finite


def _rotate_plain(rope: Rope, x: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The rotation as plain torch ops, one per step of the docstring (what the model computed before its
    dispatches were trimmed)."""
    d = rope.rope_dim
    angles = positions.to(torch.float32)[..., None] * rope.freqs
    cis = torch.polar(torch.ones_like(angles), angles)
    if inverse:
        cis = cis.conj()
    if x.dtype == torch.float64:
        cis = cis.to(torch.complex128)
    tail = x[..., x.shape[-1] - d :]
    tail = tail if tail.dtype == torch.float64 else tail.float()
    pairs = torch.view_as_complex(tail.unflatten(-1, (d // 2, 2)).contiguous())
    out = x.clone()
    out[..., x.shape[-1] - d :] = torch.view_as_real(pairs * cis).flatten(-2).to(x.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_equals_the_plain_ops_bit_for_bit(v41, dtype, inverse):
    rope = Rope.for_layer(v41, 4)
    g = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 1 << 20, (33,), generator=g)
    for x in (
        torch.randn(33, 576, generator=g).to(dtype),  # a window entry [T, D]
        torch.randn(33, 8, 512, generator=g).to(dtype).transpose(0, 1),  # queries as [H, T, D], strided
    ):
        got = rope.rotate(x, positions, inverse=inverse)
        assert got.dtype == dtype and got.stride() == x.clone().stride()
        assert torch.equal(got, _rotate_plain(rope, x, positions, inverse))


def test_one_rotation_serves_every_tensor_at_its_positions(v41):
    """A decode step rotates q, window kv, index q and (inverse) the output of every layer sharing a table by one
    `Rotation`: each equals its own plain rotation, forward and inverse, and the rotation is not consumed."""
    rope = Rope.for_layer(v41, 4)
    g = torch.Generator().manual_seed(9)
    positions = torch.randint(0, 1 << 20, (5,), generator=g)
    rot = rope.at(positions)
    assert rot.cis.shape == (5, rope.rope_dim // 2) and not rot.cis_inverse.is_conj()
    for x in (
        torch.randn(5, 576, generator=g),
        torch.randn(5, 8, 512, generator=g).transpose(0, 1),
        torch.randn(5, 4, 128, generator=g, dtype=torch.float64).transpose(0, 1),
    ):
        for inverse in (False, True, False):
            assert torch.equal(rot.apply(x, inverse=inverse), _rotate_plain(rope, x, positions, inverse))
    with pytest.raises(ValueError, match="rope_dim"):
        rot.apply(torch.ones(5, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_adds_like_the_python_float(dtype):
    from kvdiet.model.layers import constant

    x = torch.randn(1000, generator=torch.Generator().manual_seed(8), dtype=dtype) * 1e-6
    for value in (1e-20, 1e-6, 1.5, 0.1):
        c = constant(value, dtype)
        assert c is constant(value, dtype) and c.dim() == 0 and c.dtype == dtype
        assert torch.equal(x + c, x + value) and torch.equal(x * c, x * value)


def test_rmsnorm_equals_the_plain_ops_bit_for_bit():
    norm = RMSNorm(64, 1e-6)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    for x in (torch.randn(1, 64, generator=g), torch.randn(300, 64, generator=g) * 1e-3):
        assert torch.equal(norm(x), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * norm.weight)
