"""The compiled FP4 and FP8 kernels (``formats.native``) against the pure-torch path, bit for bit.

Every (value byte, scale byte) pair through decode, every E2M1 rounding boundary at many scales, subnormal,
huge and signed-zero inputs in each input dtype through encode, and the same errors naming the same row. The
FP8 decode against its formula under every scale byte, and the decode step's fused window read (`fp8.read_window`)
against `Codec.read_window`'s torch path; the AVX2 and scalar builds too (slow).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvdiet.formats import fp4, fp8, mxfp4, native

CODECS = [
    pytest.param(fp4.encode_main_kv, fp4.decode_main_kv, fp4.MAIN_KV, 512, id="fp4_e2m1_e4m3x16"),
    pytest.param(mxfp4.encode_index_key, mxfp4.decode_index_key, mxfp4.INDEX_KEY, 128, id="mxfp4"),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize(("encode", "decode", "recipe", "dim"), CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_every_value_byte_and_scale_byte(both, encode, decode, recipe, dim, dtype):
    lo, hi = recipe.scale_bytes
    block_bytes = recipe.block // 2
    scale_bytes = torch.arange(lo, hi + 1, dtype=torch.uint8)
    # one block per (scale byte, run of block_bytes value bytes); every value byte under every scale byte
    values = torch.arange(256, dtype=torch.uint8).view(-1, block_bytes)  # [256/block_bytes, block_bytes]
    blocks = torch.cat(
        [values.repeat(len(scale_bytes), 1), scale_bytes.repeat_interleave(len(values)).unsqueeze(1)], 1
    )
    nb = dim // recipe.block
    blocks = blocks[: len(blocks) // nb * nb].view(-1, nb, block_bytes + 1)
    packed = torch.cat([blocks[..., :block_bytes].reshape(len(blocks), -1), blocks[..., block_bytes]], 1)
    compiled, pure = both(decode, packed, dtype=dtype)
    assert compiled.dtype == dtype and torch.equal(_bits(compiled), _bits(pure))


def _boundary_inputs(dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of values at, just below and just above every E2M1 midpoint and grid point, at many scales."""
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 6.5])
    near = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    near = torch.cat([near, -near, torch.tensor([-0.0, 7.0, 1e-45, 2.0**-126, 2.0**-149])])
    rows = []
    for exponent in (-140, -130, -126, -100, -12, -9, -6, -1, 0, 1, 5, 9, 60, 120, 126):
        row = (near * 2.0**exponent).float()
        rows.append(torch.cat([row, row.flip(0)]).repeat(dim)[:dim])
    x = torch.stack(rows)
    x = torch.cat([x, torch.randn(64, dim, generator=torch.Generator().manual_seed(3))])
    x = torch.cat([x, x * 1e-30, x * 1e30, torch.zeros(2, dim), torch.full((1, dim), 3.4e38)])
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


@pytest.mark.parametrize(("encode", "decode", "recipe", "dim"), CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encode_matches_at_every_rounding_boundary(both, encode, decode, recipe, dim, dtype):
    x = _boundary_inputs(dim, dtype)
    compiled, pure = both(encode, x)
    assert torch.equal(compiled, pure)
    for out_dtype in (torch.float32, torch.bfloat16):
        decoded, expected = both(decode, compiled, dtype=out_dtype)
        assert torch.equal(_bits(decoded), _bits(expected))


@pytest.mark.parametrize(("encode", "decode", "recipe", "dim"), CODECS)
@pytest.mark.parametrize("env", [None, "0"], ids=["compiled", "pure"])
def test_errors_name_the_same_row(monkeypatch, encode, decode, recipe, dim, env):
    if env:
        monkeypatch.setenv(native.ENV, env)
    x = torch.randn(9, 3, dim, generator=torch.Generator().manual_seed(4))
    x[5, 1, 7] = float("nan")  # row 16 of the flattened input
    with pytest.raises(ValueError, match=rf"^{recipe.name}: input holds a non-finite .* in row 16$"):
        encode(x)
    packed = encode(torch.randn(9, dim))
    packed[6, -1] = 0  # no recipe writes scale byte 0
    with pytest.raises(ValueError, match=rf"^{recipe.name}: stored scale byte 0 is outside"):
        decode(packed)


def test_environment_selects_the_pure_torch_path(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    assert native.fp4_kernels() is None
    monkeypatch.setenv(native.ENV, "1")
    assert native.fp4_kernels() is not None
    # only the exact value "0" switches them off, however the variable is set or removed
    for value in ("0", "00", "", " 0", "false", "1"):
        os.environ[native.ENV] = value
        assert (native.fp4_kernels() is None) == (value == "0")
    del os.environ[native.ENV]
    assert native.fp4_kernels() is not None
    monkeypatch.setattr(native, "_ENCODED", None)  # an os.environ without CPython's encoders: the public read
    monkeypatch.setenv(native.ENV, "0")
    assert native.fp4_kernels() is None


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_process() -> None:
    """torch's build lock (a ``lock`` file in the build folder) outlives a build killed mid-way, and torch
    waits on it forever: a later kvdiet process must still load the kernels, saying what it removed."""
    kernels = native.fp4_kernels()
    assert kernels is not None
    lock = Path(kernels.__file__).parent / "lock"
    lock.touch()  # as a build killed between taking torch's lock and releasing it leaves it
    code = "from kvdiet.formats.native import fp4_kernels; print(fp4_kernels() is not None)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "True", done.stderr
    assert "removing the lock a killed build left" in done.stderr and not lock.exists()


def _e4m3_boundaries(scale_exponents: range) -> torch.Tensor:
    """fp32 rows [*, 512]: every E4M3 value's neighbours and midpoints, under many block scales."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    eps = torch.tensor(1.0 + 2.0**-20)
    base = torch.cat(
        [grid, mids, mids * eps, mids / eps, grid * eps, grid / eps, torch.tensor([500.0, 1e-6])]
    )
    base = torch.cat([base, -base])
    rows = []
    for e in scale_exponents:
        values = base * 2.0**e
        values = torch.cat([values, values.new_zeros(-len(values) % 512)])
        rows.append(values.view(-1, 512))
    out = torch.cat(rows)
    out[0, :32] = 0.0  # an all-zero block (the 2^-22 sentinel scale)
    out[1, :32] = -0.0
    out[2, :32] = 2.0**-140  # subnormal inputs flush
    out[3, :32] = 3e38  # the capped exponent saturates
    return out


def test_fp8_window_encode_equals_pure_torch_on_every_rounding_boundary(both):
    x = _e4m3_boundaries(range(-30, 40, 7))
    x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(5))]
    compiled, pure = both(fp8.encode_window, x)
    assert compiled.dtype == torch.uint8 and torch.equal(compiled, pure)
    assert compiled.shape == (len(x), 528)


def test_fp8_window_decode_every_code_under_every_scale_byte(both):
    lo, hi = fp8.SCALE_BYTES
    scales = torch.arange(lo, hi + 1, dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)  # 0x7F / 0xFF included (read as ±480)
    blocks = codes.repeat(len(scales), 1)  # [8·S, 32]: every code under every scale byte
    nb = 16
    blocks = blocks[: len(blocks) // nb * nb].view(-1, nb * 32)
    scale_bytes = scales.repeat_interleave(8)[: blocks.shape[0] * nb].view(-1, nb)
    packed = torch.cat([blocks, scale_bytes], 1)
    compiled, pure = both(fp8.decode_window, packed)
    assert torch.equal(compiled.view(torch.int32), pure.view(torch.int32))
    assert torch.isfinite(compiled).all()


@pytest.mark.parametrize("env", [None, "0"], ids=["compiled", "pure"])
def test_fp8_window_errors_name_the_same_row(monkeypatch, env):
    if env:
        monkeypatch.setenv(native.ENV, env)
    x = torch.randn(9, 3, 512, generator=torch.Generator().manual_seed(6))
    x[4, 2, 100] = float("inf")  # row 14 of the flattened input
    with pytest.raises(ValueError, match=r"^mxfp8: input holds a non-finite .* in row 14$"):
        fp8.encode_window(x)
    packed = fp8.encode_window(torch.randn(9, 512))
    packed[3, -1] = 0
    with pytest.raises(ValueError, match=r"^mxfp8: stored scale byte 0 is outside"):
        fp8.decode_window(packed)


def test_kernels_run_on_torchs_intra_op_threads() -> None:
    """Built with OpenMP, the kernels' at::parallel_for uses torch's threads (without it: one thread, silently)."""
    kernels = native.fp4_kernels()
    assert kernels is not None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernels.parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert kernels.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(before)


def _every_code_under(scale_bytes: torch.Tensor, dim: int) -> torch.Tensor:
    """Entries uint8 [odd rows, 33·dim/32]: every E4M3 code under every byte of ``scale_bytes`` (8 blocks of 32
    codes per byte), padded with repeats to an odd row count."""
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32).repeat(len(scale_bytes), 1)
    scales = scale_bytes.repeat_interleave(8)
    nb = dim // 32
    rows = -(-len(scales) // nb)
    rows += 1 - rows % 2
    pad = rows * nb - len(scales)
    codes, scales = torch.cat([codes, codes[:pad]]), torch.cat([scales, scales[:pad]])
    return torch.cat([codes.view(rows, dim), scales.view(rows, nb)], 1)


def _dequantize_reference(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The kernel's formula in torch: ``(half(code) · 256) · 2^(byte − 127)``, half(code) the fp16 whose bits
    are the code sign-extended, shifted left 7, bit 14 cleared (fp8.py); the scale made from its bits."""
    half = ((packed[:, :dim].view(torch.int8).to(torch.int16) << 7) & -0x4001).view(torch.float16).float()
    s = (packed[:, dim:].to(torch.int32) << 23).view(torch.float32)
    return ((half * 256.0).view(len(packed), -1, 32) * s[..., None]).view(len(packed), dim)


def check_decode_kernel() -> None:
    """`decode_fp8` against its formula on every code under scale bytes 0..254 (subnormal, zero and huge results
    where the bytes are outside the written range), at odd row counts, row strides and widths."""
    kernels = native.fp4_kernels()
    assert kernels is not None
    for dim in (32, 96, 512):
        packed = _every_code_under(torch.arange(255, dtype=torch.uint8), dim)
        width = packed.shape[1]
        strided = torch.full((len(packed), width + 13), 0x55, dtype=torch.uint8)
        strided[:, :width] = packed
        for rows in (packed, strided[:, :width]):
            out = torch.full((len(rows), dim), float("nan"))
            assert kernels.decode_fp8(rows, 0, 255, out) == -1
            want = _dequantize_reference(packed, dim)
            assert torch.equal(out.view(torch.int32), want.view(torch.int32)), dim
        assert ((want != 0) & (want.abs() < torch.finfo(torch.float32).tiny)).any()  # subnormal results
        assert (want == 0).any() and torch.isinf(want).any()  # and overflows (bytes past 246)
    # what the window recipe writes reads the same through decode_window's torch path
    lo, hi = fp8.SCALE_BYTES
    packed = _every_code_under(torch.arange(lo, hi + 1, dtype=torch.uint8), 512)
    out = torch.empty(len(packed), 512)
    assert kernels.decode_fp8(packed, lo, hi, out) == -1
    assert torch.equal(out.view(torch.int32), _dequantize_reference(packed, 512).view(torch.int32))


def test_fp8_decode_kernel_equals_its_formula_on_every_code_and_scale_byte() -> None:
    check_decode_kernel()


@pytest.mark.parametrize("threads", [1, 2])
def test_fp8_decode_kernel_reports_the_first_bad_row(threads: int) -> None:
    kernels = native.fp4_kernels()
    assert kernels is not None
    packed = fp8.encode_window(torch.randn(1001, 512, generator=torch.Generator().manual_seed(8)))
    lo, hi = fp8.SCALE_BYTES
    packed[900, 512 + 3] = hi + 1
    packed[777, 512 + 15] = lo - 1
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = torch.empty(1001, 512)
        assert kernels.decode_fp8(packed, lo, hi, out) == 777
        assert kernels.decode_fp8(packed[778:], lo, hi, out[778:]) == 900 - 778
    finally:
        torch.set_num_threads(before)


def _window_inputs(
    batch: int, *, strided: bool
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(kv fp32 [B, 512] of adversarial values, B rings uint8 [16, 528] (rows not held hold scale byte 0),
    slots int64 [B, 11] in any order with repeats, held bool [B, 11] partly False)."""
    gen = torch.Generator().manual_seed(batch)
    window, n = 16, 11
    x = _e4m3_boundaries(range(-30, 40, 13))
    kv = x[torch.randint(len(x), (batch,), generator=gen)].clone()
    kv[0, :32] = -0.0
    kv[0, 32:64] = 2.0**-140
    kv[-1, 64:96] = 3e38
    kv[-1, 96] = 224 * 2.0**-3  # a block whose top code is 224: encode(decode(e)) rescales it
    rings = []
    for b in range(batch):
        ring = fp8.encode_window(x[torch.randint(len(x), (window,), generator=gen)])
        ring[b % window, 512:] = 0  # never written: does not decode
        if strided:
            buffer = torch.zeros(window, 600, dtype=torch.uint8)
            buffer[:, :528] = ring
            ring = buffer[:, :528]
        rings.append(ring)
    slots = torch.randint(window, (batch, n), generator=gen)
    slots[:, 0] = (torch.arange(batch) + 1) % window
    slots[:, 1] = slots[:, 0]  # a repeat
    slots[:, 2] = torch.arange(batch) % window  # the row that does not decode ...
    held = torch.rand(batch, n, generator=gen) < 0.7
    held[:, 2] = False  # ... is not held
    held[(slots == (torch.arange(batch) % window)[:, None])] = False
    held[:, 0] = True
    return kv, rings, slots, held


def _pure(fn, *args):
    """``fn(*args)`` on the pure-torch path (``KVDIET_NATIVE_KERNELS=0``), the variable restored after."""
    before = os.environ.get(native.ENV)
    os.environ[native.ENV] = "0"
    try:
        return fn(*args)
    finally:
        if before is None:
            del os.environ[native.ENV]
        else:
            os.environ[native.ENV] = before


def check_window_read() -> None:
    """`fp8.read_window` (the compiled window read) against `Codec.read_window`'s torch path (what `_window`
    ran before it) and against its definition, bit for bit, at B = 1 and 3, contiguous and strided rings, held
    partly or fully."""
    from kvdiet.formats.codec import CacheCodecs

    codec = CacheCodecs.for_dims(512, 128).window
    for batch, strided in ((1, False), (3, False), (1, True), (3, True)):
        kv, rings, slots, held = _window_inputs(batch, strided=strided)
        for h in (held, None):
            if h is None:
                for ring in rings:
                    ring[:, 512:] = ring[:, 512:].clamp(*fp8.SCALE_BYTES)  # every row decodes
            fused = fp8.read_window(kv, rings, slots, h)
            assert fused is not None  # the kernel takes it
            keys, entries = fused
            want_keys, want_entries = _pure(codec.read_window, kv, rings, slots, h)
            assert torch.equal(keys.view(torch.int32), want_keys.view(torch.int32))
            assert torch.equal(entries, want_entries)
            new = fp8.decode_window(fp8.encode_window(kv))
            assert torch.equal(keys[:, -1].view(torch.int32), new.view(torch.int32))
            assert torch.equal(entries, fp8.encode_window(new))
            for b in range(batch):
                for j, slot in enumerate(slots[b].tolist()):
                    want = fp8.decode_window(rings[b][slot]) if h is None or h[b, j] else new[b]
                    assert torch.equal(keys[b, j].view(torch.int32), want.view(torch.int32)), (b, j)
        assert not torch.equal(entries, fp8.encode_window(kv))  # the 224 block: stored at half the scale


def test_fp8_window_read_equals_the_torch_path() -> None:
    check_window_read()


@pytest.mark.parametrize("env", [None, "0"], ids=["compiled", "pure"])
def test_fp8_window_read_errors(monkeypatch, env) -> None:
    from kvdiet.formats.codec import CacheCodecs

    if env:
        monkeypatch.setenv(native.ENV, env)
    codec = CacheCodecs.for_dims(512, 128).window
    kv, rings, slots, held = _window_inputs(3, strided=False)
    for bad in (-1, 16):
        wrong = slots.clone()
        wrong[1, 4] = bad
        with pytest.raises(ValueError, match=r"^mxfp8: window slots must lie in \[0, 16\), got "):
            codec.read_window(kv, rings, wrong, held)
    with pytest.raises(ValueError, match=r"^mxfp8: stored scale byte 0 is outside"):
        codec.read_window(kv, rings, slots, None)  # the held rows include one that does not decode
    kv[2, 7] = float("nan")
    with pytest.raises(ValueError, match=r"^mxfp8: input holds a non-finite .* in row 2$"):
        codec.read_window(kv, rings, slots, held)


def test_fp8_window_read_writes_into_a_buffer_of_its_shape() -> None:
    """``out`` of the keys' shape (float32, contiguous) gets the keys and is returned, over what it held; another
    shape, dtype or a strided view is left alone and a new tensor returned: the same keys each time."""
    kv, rings, slots, held = _window_inputs(3, strided=False)
    want, entries = fp8.read_window(kv, rings, slots, held)
    out = torch.full_like(want, float("nan"))
    got, got_entries = fp8.read_window(kv, rings, slots, held, out)
    assert got is out and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(got_entries, entries)
    wide = torch.full((3, want.shape[1], 2 * want.shape[2]), 7.0)
    for other in (torch.zeros(3, want.shape[1] + 1, want.shape[2]), out.double(), wide[:, :, ::2]):
        before = other.clone()
        got, _ = fp8.read_window(kv, rings, slots, held, other)
        assert got is not other and torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert torch.equal(other, before)


def test_fp8_window_read_declines_what_the_kernel_does_not_take() -> None:
    kv, rings, slots, held = _window_inputs(3, strided=False)
    assert fp8.read_window(kv, rings, slots, held) is not None
    assert fp8.read_window(kv.double(), rings, slots, held) is None
    assert fp8.read_window(kv, rings[:2], slots, held) is None
    assert fp8.read_window(kv, rings, slots.int(), held) is None
    assert fp8.read_window(kv, rings, slots[:, ::2], held[:, ::2]) is None
    assert fp8.read_window(kv, rings, slots, held[:, :-1].contiguous()) is None
    assert fp8.read_window(kv[:, :500].contiguous(), rings, slots, held) is None
    assert fp8.read_window(kv, [r[:, :-1] for r in rings], slots, held) is None


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_fp8_decode_and_window_read_of_other_isa_builds(isa: str) -> None:
    """The AVX2 + F16C and the scalar builds (``ATEN_CPU_CAPABILITY`` picks the build; each about a minute
    to compile once) give the same bits, the FP4 gather's too (`test_formats_gather.check_gather`), and the
    attention reads bf16 entries as their values (`test_model_decode_attend.check_bf16_entries`)."""
    code = (
        "import sys; sys.path.insert(0, 'tests'); import test_formats_native as t; from kvdiet.formats import native\n"
        f"assert native.cpu_isa() == {'AVX2' if isa == 'avx2' else 'base'!r}, native.cpu_isa()\n"
        "import test_formats_gather as g, test_model_decode_attend as a\n"
        "t.check_decode_kernel(); t.check_window_read(); g.check_gather(); a.check_bf16_entries(); print('ok')"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa}
    root = Path(__file__).parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=root
    )
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("env", [None, "0"], ids=["compiled", "pure"])
def test_fp8_window_read_checks_each_ring_and_the_ring_count(monkeypatch, env) -> None:
    """A slot is checked against its own request's ring (rings of different lengths), and the rings must be one
    per request: both raise before anything is read, on both paths."""
    from kvdiet.formats.codec import CacheCodecs

    if env:
        monkeypatch.setenv(native.ENV, env)
    codec = CacheCodecs.for_dims(512, 128).window
    kv, rings, slots, held = _window_inputs(3, strided=False)
    short = [rings[0], rings[1][:12], rings[2]]  # request 1's ring holds 12 rows
    wrong = slots.clone()
    wrong[1, 4], wrong[0, 4] = 13, 15  # 15 fits request 0's ring, 13 does not fit request 1's
    with pytest.raises(ValueError, match=r"^mxfp8: window slots must lie in \[0, 12\), got .* \(request 1\)"):
        codec.read_window(kv, short, wrong, held)
    with pytest.raises(ValueError, match=r"^mxfp8: one ring per row of slots"):
        codec.read_window(kv, rings[:2], slots, held)


def test_fp8_window_read_of_a_negative_view_and_under_another_default_dtype() -> None:
    """A lazily negated key is read as its value, and a float64 default dtype changes nothing: the same result as
    the pure-torch path on a plain key."""
    from kvdiet.formats.codec import CacheCodecs

    codec = CacheCodecs.for_dims(512, 128).window
    kv, rings, slots, held = _window_inputs(3, strided=False)
    held = torch.ones_like(held)
    held[:, 2] = False  # the row that does not decode is not read
    want = codec.read_window(kv, rings, slots, held)
    got = codec.read_window(torch._neg_view(-kv), rings, slots, held)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = codec.read_window(kv, rings, slots, held)
    finally:
        torch.set_default_dtype(default)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fp8_decode_keeps_e4m3_subnormal_codes_under_flush_denormal() -> None:
    """The vector decode widens E4M3 codes through fp16, where the E4M3 subnormals are fp16 subnormals:
    ``torch.set_flush_denormal(True)`` (FTZ/DAZ on the calling thread; one thread so the kernel runs there) must
    not zero them. Every code under every scale byte the window recipe writes decodes as without it, on both
    paths, and the subnormal codes stay nonzero."""
    lo, hi = fp8.SCALE_BYTES
    packed = _every_code_under(torch.arange(lo, hi + 1, dtype=torch.uint8), 512)
    want = _dequantize_reference(packed, 512)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
        compiled = fp8.decode_window(packed)
        with pytest.MonkeyPatch.context() as m:
            m.setenv(native.ENV, "0")
            pure = fp8.decode_window(packed)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    for got in (compiled, pure):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    codes = packed[:, :512].reshape(-1)
    subnormal = ((codes & 0x78) == 0) & ((codes & 0x07) != 0)  # exponent 0, mantissa not 0
    assert subnormal.any() and (compiled.reshape(-1)[subnormal] != 0).all()


@pytest.mark.parametrize(("device", "loads"), [("cpu", True), ("cuda", False)])
def test_a_cpu_model_loads_its_kernels_before_its_first_forward(monkeypatch, device, loads) -> None:
    # a first `generate` otherwise counts the kernels' one-time build (about a minute) as prefill time
    from kvdiet.model import build

    calls = []
    monkeypatch.setattr(native, "fp4_kernels", lambda: calls.append(1))
    monkeypatch.setattr(build, "check_device", lambda d: None)  # no GPU here: stop before placing the model
    monkeypatch.setattr(build, "load_config", lambda name: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"):
        build.load_model("v4.1-micro", device=device)
    assert bool(calls) == loads
