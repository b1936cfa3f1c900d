"""The model on each device (the ``device`` fixture: cpu always, cuda on a GPU machine): the cached paths
against the CPU's no-cache reference, batched decode, the paged pool's bytes, a window snapshot round trip,
the engine's generate — and nothing left on another device, nor allocated outside the device scope."""

from __future__ import annotations

import json

import pytest
import torch
from torch.overrides import TorchFunctionMode

import kvdiet.model.transformer as transformer_module
from kvdiet.cli import main
from kvdiet.config import load_config
from kvdiet.formats.codec import CacheCodecs
from kvdiet.model.placement import place, tensors_off_device
from kvdiet.model.reference import forward_full
from kvdiet.model.snapshot import restore_snapshot, snapshot_bytes
from kvdiet.model.transformer import Transformer

TOL = 1e-4  # as tests/test_model_paths.py: fp32, caches unquantised or packed
_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.tensor,
    torch.as_tensor,
    torch.randn,
    torch.rand,
    torch.randint,
    torch.eye,
    torch.linspace,
    torch.frombuffer,
    torch.from_numpy,
}


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=[True, False], ids=["exact", "quantized"])
def cpu_model(request) -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=0, exact=request.param)


@pytest.fixture
def model(cpu_model: Transformer, device: str) -> Transformer:
    """The same weights as ``cpu_model``, placed on ``device`` (a copy on CUDA, the model itself on cpu)."""
    if device == "cpu":
        return cpu_model
    copy = Transformer.from_config(load_config("v4.1-micro"), seed=0, exact=cpu_model.exact)
    return place(copy, device)


def test_decode_on_the_device_equals_the_cpu_reference(cpu_model: Transformer, model: Transformer) -> None:
    toks = _tokens(40)
    ref = forward_full(cpu_model, torch.tensor(toks))
    state = model.new_state()
    dec = torch.cat([model.decode([state], [t]).cpu() for t in toks])
    worst = (dec - ref).abs().amax(-1)
    # as tests/test_model_paths.py: with packed caches one position may round a value across a code boundary
    # (a decode row's products run in another fp32 order than the reference's; the BLAS's order differs by CPU)
    assert int((worst > TOL).sum()) <= (0 if model.exact else 1)
    assert worst.max().item() <= (TOL if model.exact else 2e-3)
    assert tensors_off_device(model, [state], model.device) == []


def test_chunked_prefill_equals_one_shot_on_the_device(model: Transformer) -> None:
    toks = _tokens(37, seed=2)
    one = model.prefill(model.new_state(), toks, decoder_replay=False, all_logits=True)
    assert one.device == model.device
    for split in (1, 8, 17, 36):
        state = model.new_state()
        a = model.prefill(state, toks[:split], decoder_replay=False, all_logits=True)
        b = model.prefill(state, toks[split:], decoder_replay=False, all_logits=True)
        assert (torch.cat([a, b]) - one).abs().max().item() <= TOL, split


def test_batched_decode_equals_one_request_at_a_time(model: Transformer) -> None:
    prompts = [_tokens(n, seed=n) for n in (5, 18, 33)]
    batch = [model.new_state() for _ in prompts]
    alone = [model.new_state() for _ in prompts]
    for sb, sa, p in zip(batch, alone, prompts, strict=True):
        model.prefill(sb, p)
        model.prefill(sa, p)
    for step in range(3):
        tokens = [7 + step, 11 + step, 13 + step]
        together = model.decode(batch, tokens)
        one_by_one = torch.cat([model.decode([s], [t]) for s, t in zip(alone, tokens, strict=True)])
        assert (together - one_by_one).abs().max().item() <= TOL
    assert tensors_off_device(model, batch + alone, model.device) == []


def test_the_pools_blocks_cross_as_the_cpus_bytes(cpu_model: Transformer, model: Transformer) -> None:
    toks = _tokens(70, seed=4)  # one full block of 64 and a partial one
    here, there = cpu_model.new_state(), model.new_state()
    cpu_model.prefill(here, toks)
    model.prefill(there, toks)
    block = there.table.pool.read_block(there.table.ids[0])
    assert len(block) == there.table.pool.block_bytes
    if (
        model.exact
    ):  # fp32 entries: equal to the CPU's within fp32 tolerance, byte-identical on the CPU itself
        got = torch.frombuffer(bytearray(block), dtype=torch.float32)
        want = torch.frombuffer(bytearray(here.table.pool.read_block(here.table.ids[0])), dtype=torch.float32)
        assert (got - want).abs().max().item() <= TOL
    spare = model.new_state()
    spare.table.reserve(64)
    spare.table.pool.write_block(spare.table.ids[0], block)
    assert spare.table.pool.read_block(spare.table.ids[0]) == block


def test_a_snapshot_round_trip_continues_as_the_original(model: Transformer) -> None:
    toks = _tokens(30, seed=5)
    state = model.new_state()
    model.prefill(state, toks)
    data = snapshot_bytes(state, b"fp")
    twin = model.new_state()
    model.prefill(twin, toks)  # the global KV the snapshot needs; then its local state is emptied
    for part in [*twin.windows, *twin.tails.values()]:
        part.clear()
    assert snapshot_bytes(twin, b"fp") != data
    restore_snapshot(twin, data, b"fp")
    assert snapshot_bytes(twin, b"fp") == data
    a, b = model.decode([state], [9]), model.decode([twin], [9])
    assert torch.equal(a, b)
    assert tensors_off_device(model, [state, twin], model.device) == []


def test_the_engine_generates_the_cpus_tokens(device: str, capsys) -> None:
    base = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3,4,5,6", "--max-tokens", "3"]
    runs = []
    for dev in ("cpu", device):
        assert main([*base, "--persistent-dir", "none", "--device", dev, "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[1]["output_ids"] == runs[0]["output_ids"] and len(runs[0]["output_ids"]) == 3


class _Undeviced(TorchFunctionMode):
    """Records torch factory calls that name no device (they land on torch's default: the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            import traceback

            frame = traceback.extract_stack(limit=2)[0]
            self.calls.append(f"{func.__name__} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}")
        return func(*args, **kwargs)


def test_every_allocation_names_its_device_or_runs_in_the_scope(monkeypatch) -> None:
    """On the CPU the device scope pushes nothing (`kvdiet.device.device_scope`), so it is forced here: then a
    tensor made without ``device=`` outside the scope — the kind that stays on the CPU beside a CUDA model —
    is caught on a CPU-only machine."""
    model = Transformer.from_config(load_config("v4.1-micro"), seed=0)
    monkeypatch.setattr(transformer_module, "device_scope", torch.device)
    first, second = _tokens(21), _tokens(6, seed=3)
    with _Undeviced() as seen:
        states = [model.new_state() for _ in range(2)]
        model.prefill(states[0], first)
        model.prefill(states[1], second)
        model.decode(states, [3, 4])
        model.rewind(states[1], 0, second)
        restore_snapshot(states[0], snapshot_bytes(states[0], b"fp"), b"fp")
        model.decode(states, [5, 6])
    assert seen.calls == []


@pytest.mark.parametrize("v4", [False, True], ids=["v41-codecs", "v4-codecs"])
def test_the_codecs_allocate_on_their_inputs_device(device: str, v4: bool, monkeypatch) -> None:
    """A codec called outside the device scope (a cache comparison, a benchmark filling a pool) allocates on
    its input's device: the torch path makes no tensor without ``device=``, and the device gives the CPU's
    bytes and values."""
    monkeypatch.setenv("KVDIET_NATIVE_KERNELS", "0")  # the torch path: the one CUDA runs
    codecs = CacheCodecs.for_v4(512, 128, 64) if v4 else CacheCodecs.for_dims(512, 128)
    g = torch.Generator().manual_seed(7)
    for codec in (codecs.main, codecs.index_key, codecs.window):
        x = torch.randn(70, codec.dim, generator=g) * torch.logspace(-3, 3, 70)[:, None]
        want = codec.encode(x)
        with _Undeviced() as seen:
            rows = codec.encode(x.to(device))
            back = codec.decode(rows)
        assert seen.calls == [], codec.name
        assert rows.device.type == torch.device(device).type
        assert torch.equal(rows.cpu(), want), codec.name
        assert torch.equal(back.cpu(), codec.decode(want)), codec.name


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "--device must be cpu, cuda or cuda:N, got 'tpu'"),
        ("cuda:x", "--device must be cpu, cuda or cuda:N, got 'cuda:x'"),
        pytest.param(
            "cuda",
            "--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machines' case"),
        ),
    ],
)
def test_a_bad_device_is_one_line_before_anything_loads(device: str, message: str, capsys) -> None:
    # the weights do not exist: a device error first means nothing was read before the check
    args = ["generate", "--weights", "/nonexistent/kvdiet", "--prompt-ids", "1", "--device", device]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == f"kvdiet generate: error: {message}"
    assert main(["replay", "trace.jsonl", "--device", device]) == 2  # model-free too: checked, as --threads
    assert capsys.readouterr().err.strip() == f"kvdiet replay: error: {message}"


def test_the_machine_is_named_from_cpuinfo_or_else_the_platform(tmp_path, monkeypatch) -> None:
    """`machine_name`: the first ``model name`` of cpuinfo and the cores this process may use; without one (or
    without the file), the platform's processor, else "unknown CPU"."""
    import platform

    from kvdiet.device import machine_name
    from kvdiet.threads import available_cores

    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: avx512f\n\nmodel name\t: other\n"
    )
    assert machine_name(cpuinfo=info) == f"AMD EPYC 9R14, {available_cores()} cores"
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    assert machine_name(cpuinfo=tmp_path / "missing") == f"x86_64, {available_cores()} cores"
    info.write_text("processor\t: 0\nmodel name\t:\nstepping\t: 1\n")  # an empty name: not the next line
    assert machine_name(cpuinfo=info) == f"x86_64, {available_cores()} cores"
    info.write_text("processor\t: 0\n")
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert machine_name(cpuinfo=info) == f"unknown CPU, {available_cores()} cores"
