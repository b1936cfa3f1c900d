"""Engine settings from Python: the model's defaults as on the command line, policy names, the exports of
``kvdiet``, and errors that name each setting the way its caller spelled it (keyword or flag)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvdiet
from kvdiet import LLM, CacheOptions, EngineArgs, parse_policy
from kvdiet.cache.policies import BoundarySnapshot, BoundedReplay, Checkpoint, FullStore
from kvdiet.cli import main
from kvdiet.setting_error import SettingError, flag_name
from redis_helpers import free_port  # serve is refused before binding; a free port all the same


def _no_load(*args: object, **kwargs: object) -> None:
    raise AssertionError("the model was loaded before the setting was refused")


def test_llm_applies_the_v4_flash_defaults_of_the_command_line() -> None:
    """``v4-mini`` (V4-Flash) gets blocks of 128 tokens and boundary snapshots when the caller leaves them unset,
    as ``kvdiet generate`` / ``serve`` do; a given policy wins over the default."""
    with LLM("v4-mini", max_model_len=2048) as llm:
        opts = llm.engine.runner.options
        assert opts.block_size == 128 and isinstance(opts.policy, BoundarySnapshot)
    with LLM("v4-mini", max_model_len=2048, cache=CacheOptions(policy="bounded-replay")) as llm:
        opts = llm.engine.runner.options
        assert opts.block_size == 128 and isinstance(opts.policy, BoundedReplay)


def test_the_defaults_live_in_one_place_for_the_cli_and_python() -> None:
    for model, bs, policy in (("v4-mini", 128, BoundarySnapshot), ("v4.1-micro", 64, BoundedReplay)):
        cli = EngineArgs.from_cli_args(_parse(["--model", model, "--prompt", "x"])).cache
        assert (cli.block_size, type(cli.policy)) == (bs, policy)
        resolved = CacheOptions().for_model(v4_flash=model == "v4-mini")
        assert resolved == cli
    given = CacheOptions(block_size=256, policy=FullStore()).for_model(v4_flash=True)
    assert given.block_size == 256 and isinstance(given.policy, FullStore)  # a given value is kept


def _parse(argv: list[str]):
    from kvdiet.cli import _build_parser

    return _build_parser().parse_args(["generate", *argv])


def test_an_invalid_block_size_is_refused_before_the_model_loads(monkeypatch) -> None:
    monkeypatch.setattr("kvdiet.model.build.load_model", _no_load)
    with pytest.raises(SettingError) as info:
        LLM("v4-mini", max_model_len=2048, cache=CacheOptions(block_size=64))
    assert (
        str(info.value)
        == "block_size: block size 64 must be a positive multiple of every compress ratio [4, 128]"
    )
    assert info.value.as_flags().startswith("--block-size: block size 64 must be")


@pytest.mark.parametrize(
    ("kwargs", "python", "flags"),
    [
        (
            {"max_model_len": 300},
            "max_model_len must be in [1, 256] (max_position_embeddings), got 300",
            "--max-model-len must be in [1, 256] (max_position_embeddings), got 300",
        ),
        (
            {"max_num_batched_tokens": 4},
            "max_num_batched_tokens (4) must be >= max_num_seqs (16) so that every running request can decode "
            "each step",
            "--max-num-batched-tokens (4) must be >= --max-num-seqs (16) so that every running request can "
            "decode each step",
        ),
        (
            {"kv_cache_dtype": "fp16"},
            "kv_cache_dtype must be one of auto, fp4, fp32, got 'fp16'",
            "--kv-cache-dtype must be one of auto, fp4, fp32, got 'fp16'",
        ),
        (
            {"cache": CacheOptions(kv_cache_memory=100)},
            "kv_cache_memory 100 B is below one block",
            "--kv-cache-memory 100 B is below one block",
        ),
        (
            {"cache": CacheOptions(policy="checkpoint:100")},
            "policy: checkpoint period 100 must be a multiple of the block size 64",
            "--swa-policy: checkpoint period 100 must be a multiple of the block size 64",
        ),
    ],
)
def test_python_errors_name_keywords_and_the_cli_names_flags(monkeypatch, kwargs, python, flags) -> None:
    monkeypatch.setattr("kvdiet.model.build.load_model", _no_load)
    with pytest.raises(SettingError) as info:
        LLM("v4.1-micro", **kwargs)
    assert str(info.value).startswith(python) and "--" not in str(info.value)
    assert info.value.as_flags().startswith(flags)


def test_the_cli_still_names_its_flags(capsys) -> None:
    argv = ["serve", "--model", "v4.1-micro", "--port", str(free_port())]
    argv += ["--max-num-seqs", "8", "--max-num-batched-tokens", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvdiet serve: error: --max-num-batched-tokens (4) must be >= --max-num-seqs (8)")
    assert main(["generate", "--model", "v4.1-micro", "--prompt-ids", "1", "--max-model-len", "300"]) == 2
    assert capsys.readouterr().err == (
        "kvdiet generate: error: --max-model-len must be in [1, 256] (max_position_embeddings), got 300\n"
    )


def test_a_setting_with_a_value_is_spelled_per_caller() -> None:
    exc = SettingError("load with {numerics=bf16} or lower {max_model_len}")
    assert str(exc) == "load with numerics='bf16' or lower max_model_len"
    assert exc.as_flags() == "load with --numerics bf16 or lower --max-model-len"
    assert SettingError("[4, 128] {not a field}").as_flags() == "[4, 128] {not a field}"


def test_cache_options_takes_a_policy_name() -> None:
    assert isinstance(CacheOptions(policy="full-store").policy, FullStore)
    ck = CacheOptions(policy="checkpoint:1024").policy
    assert isinstance(ck, Checkpoint) and ck.checkpoint_every == 1024
    assert CacheOptions(policy="full-store") == CacheOptions(policy=parse_policy("full-store"))
    with pytest.raises(ValueError, match="unknown SWA policy 'fullstore'; choose one of"):
        CacheOptions(policy="fullstore")
    with pytest.raises(TypeError, match=r"policy must be a SwaPolicy, its name .* got 3"):
        CacheOptions(policy=3)


def test_kvdiet_exports_the_settings_lazily() -> None:
    from kvdiet.cache.options import CacheOptions as Options
    from kvdiet.cache.policies import parse_policy as parse
    from kvdiet.engine.args import EngineArgs as Args

    assert (kvdiet.CacheOptions, kvdiet.EngineArgs, kvdiet.parse_policy) == (Options, Args, parse)
    assert {"CacheOptions", "EngineArgs", "parse_policy"} <= set(kvdiet.__all__)
    code = "import sys, kvdiet; print('torch' in sys.modules, 'kvdiet.engine.args' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.split() == ["False", "False"]  # the package import stays light
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        kvdiet.Nope  # noqa: B018


def test_the_numerics_refusal_names_the_flag_on_the_command_line(capsys, tmp_path) -> None:
    from kvdiet.config import load_config
    from kvdiet.model.export import write_random_checkpoint

    write_random_checkpoint(load_config("v4.1-micro").replace(q_lora_rank=48), tmp_path, seed=0)
    assert main(["generate", "--weights", str(tmp_path), "--prompt-ids", "3,4", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("load with --numerics bf16 or use whole blocks\n") and "numerics='bf16'" not in err


def test_device_and_a_missing_config_are_named_as_keywords(tmp_path) -> None:
    with pytest.raises(SettingError, match=r"^device must be cpu, cuda or cuda:N, got 'tpu'$") as info:
        LLM("v4.1-micro", device="tpu")
    assert info.value.as_flags() == "--device must be cpu, cuda or cuda:N, got 'tpu'"
    with pytest.raises(ValueError, match=r"no config.json beside the weights .*; give the config as model$"):
        LLM(None, weights=tmp_path)
    braced = tmp_path / "{max_model_len}"  # a folder name is echoed as it is, never read as a setting
    braced.mkdir()
    with pytest.raises(SettingError) as info:
        LLM(None, weights=braced)
    assert str(info.value) == f"no config.json beside the weights {braced}; give the config as model"
    assert info.value.as_flags() == f"no config.json beside the weights {braced}; give the config as --model"


def test_the_v4_flash_device_refusal_is_spelled_per_caller(monkeypatch) -> None:
    """V4-Flash runs on the CPU only: ``LLM("v4-mini", device="cuda")`` is told ``device='cuda'`` and
    ``kvdiet generate --device cuda`` ``--device cuda`` (the device check itself passes, as on a CUDA host)."""
    from kvdiet.config import load_config
    from kvdiet.model.placement import place
    from kvdiet.model.v4 import V4Transformer

    model = V4Transformer.from_config(load_config("v4-mini"), seed=0)
    with pytest.raises(SettingError) as info:
        place(model, "cuda")
    assert str(info.value) == "device='cuda': the V4-Flash baseline model runs on the CPU only"
    assert info.value.as_flags() == "--device cuda: the V4-Flash baseline model runs on the CPU only"
    monkeypatch.setattr("kvdiet.model.build.check_device", lambda name: None)
    with pytest.raises(SettingError, match=r"^device='cuda:0': the V4-Flash"):
        LLM("v4-mini", max_model_len=2048, device="cuda:0")


def test_cache_options_take_sizes_and_ttls_as_the_flags_do_and_refuse_bad_ones() -> None:
    """Byte strings and durations are parsed as the flags parse them; a bad size, TTL or folder is refused when
    the options are made (named by keyword, and by flag on the command line), not deep in a pool or tier; an
    empty ``persistent_dir`` is refused (it put the persistent tier in the working directory)."""
    from kvdiet.engine.scheduler import SchedulerConfig

    opts = CacheOptions(kv_cache_memory="1GB", persistent_size="2MB", swa_pool_ttl_s="5m", persistent_ttl_s=7)
    assert (opts.kv_cache_memory, opts.persistent_size, opts.swa_pool_ttl_s) == (10**9, 2 * 10**6, 300.0)
    refused = {
        "kv_cache_memory": ({"kv_cache_memory": 0}, "--kv-cache-memory must be >= 1, got 0"),
        "swa_pool_size": ({"swa_pool_size": -1}, "--swa-pool-size must be >= 0, got -1"),
        "persistent_ttl_s": ({"persistent_ttl_s": 0}, "--persistent-ttl must be > 0 seconds, got 0"),
        "global_pool_ttl_s": ({"global_pool_ttl_s": "soon"}, "--global-pool-ttl: "),
        "persistent_dir": ({"persistent_dir": " "}, "--persistent-dir must name a folder"),
        "block_size": ({"block_size": 0}, "--block-size must be >= 1, got 0"),
    }
    for name, (kwargs, flags) in refused.items():
        with pytest.raises(SettingError) as info:
            CacheOptions(**kwargs)
        assert str(info.value).startswith(name) and info.value.as_flags().startswith(flags), info.value
    with pytest.raises(
        SettingError
    ) as info:  # 0 gives a Mooncake pool no segment; the in-process pool needs room
        CacheOptions(swa_pool_size=0)
    assert info.value.as_flags().startswith("--swa-pool-size must be > 0 bytes for the in-process SWA pool")
    assert CacheOptions(swa_pool="redis://127.0.0.1:6379/0", swa_pool_size=0).swa_pool_size == 0
    for kwargs in (
        {"block_size": "64"},
        {"kv_cache_memory": True},
        {"persistent_dir": 5},
        {"swa_pool_ttl_s": None},
    ):
        with pytest.raises(TypeError, match=next(iter(kwargs))):
            CacheOptions(**kwargs)
    with pytest.raises(TypeError, match=r"max_num_seqs must be an int, got 2\.5"):
        SchedulerConfig(max_num_seqs=2.5)
    with pytest.raises(SettingError, match="numerics must be one of auto, fp8, bf16, got 'int8'"):
        EngineArgs(model="v4.1-micro", numerics="int8")  # random weights too: a typo is not ignored
    with pytest.raises(SettingError) as info:
        EngineArgs(model="v4.1-micro", expert_cache_bytes=-5)
    assert info.value.as_flags() == "--expert-cache-size must be >= 0 bytes, got -5"


def test_persistent_size_takes_unbounded_and_a_ttl_refuses_it_by_name(capsys, tmp_path) -> None:
    """``--persistent-size`` (default unbounded) takes ``unbounded`` in any case as its default; a TTL needs a
    bound and says so."""
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parser.add_argument("--model", default="v4.1-micro")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    for spelled, want in (("UNBOUNDED", None), ("unbounded", None), ("2MB", 2 * 10**6)):
        args = parser.parse_args(["--persistent-dir", str(tmp_path), "--persistent-size", spelled])
        assert EngineArgs.from_cli_args(args).cache.persistent_size == want
    assert EngineArgs.from_cli_args(parser.parse_args([])).cache.persistent_size is None
    for spelled in ("none", "NONE", "None"):  # NONE made a folder of that name
        assert (
            EngineArgs.from_cli_args(parser.parse_args(["--persistent-dir", spelled])).cache.persistent_dir
            is None
        )
    assert (
        main(["generate", "--model", "v4.1-micro", "--prompt-ids", "1", "--swa-pool-ttl", "unbounded"]) == 2
    )
    assert capsys.readouterr().err.startswith(
        "kvdiet generate: error: --swa-pool-ttl: duration 'unbounded': this one needs a bound (examples: 72h"
    )


def test_serves_default_persistent_dir_that_cannot_be_used_is_one_warning_and_no_tier(
    tmp_path, caplog
) -> None:
    """``kvdiet serve``'s default folder (under ``$HOME``) that cannot be made was found only when the tier
    opened, after the model loaded, as "cannot open the index ... No such file or directory"; the same folder
    given with ``--persistent-dir`` is an error. It is now checked with the flags: one warning saying why, and
    no tier; a default that can be made is kept, and nothing is made before the tier opens."""
    import argparse
    import logging

    def options(default: str, *argv: str) -> CacheOptions:
        parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), persistent_default=default)
        parser.add_argument("--model", default="v4.1-micro")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--device", default="cpu")
        return EngineArgs.from_cli_args(parser.parse_args(list(argv))).cache

    afile = tmp_path / "afile"
    afile.write_text("x")
    with caplog.at_level(logging.WARNING, logger="kvdiet"):
        assert options(str(afile / "kv")).persistent_dir is None
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [
        f"the default --persistent-dir cannot be used: {str(afile / 'kv')!r} lies under {str(afile)!r}, which is "
        "not a folder; the persistent tier is off"
    ]
    caplog.clear()
    fine = tmp_path / "home" / "kv"
    assert options(str(fine)).persistent_dir == str(fine) and not (tmp_path / "home").exists()
    with pytest.raises(ValueError, match=r"^--persistent-dir: .* lies under .* which is not a folder"):
        options(str(fine), "--persistent-dir", str(afile / "kv"))  # given: an error, as before
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_python_takes_unbounded_where_the_command_line_does() -> None:
    """``persistent_size`` (default None: unbounded) takes ``unbounded`` as ``--persistent-size`` does; it was
    refused as "needs a bound ... taken only where it is the default", its own default. Other sizes refuse it."""
    assert CacheOptions(persistent_size=" Unbounded ").persistent_size is None
    with pytest.raises(SettingError, match="swa_pool_size: byte size 'unbounded': this one needs a bound"):
        CacheOptions(swa_pool_size="unbounded")


def test_an_empty_persistent_dir_is_refused_on_the_command_line(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--persistent-dir", ""]) == 2
    assert capsys.readouterr().err.startswith("kvdiet generate: error: --persistent-dir must name a folder")
    assert list(tmp_path.iterdir()) == []  # nothing written where the process runs


def test_a_checkpoint_folder_loads_as_the_model_or_as_the_weights(tmp_path) -> None:
    """``LLM(DIR)`` (vLLM's form) and ``LLM(weights=DIR)`` both take the config beside the weights (here
    v4.1-micro's, vocabulary 64: v4.1-mini's default config would not fit them) and give the same greedy ids."""
    from kvdiet import SamplingParams
    from kvdiet.config import load_config
    from kvdiet.model.export import write_random_checkpoint

    folder = write_random_checkpoint(load_config("v4.1-micro"), tmp_path / "ckpt", seed=3)
    params = SamplingParams(max_tokens=4, temperature=0)
    outs = []
    for llm_args in ((str(folder),), ()):
        with LLM(*llm_args, **({} if llm_args else {"weights": folder})) as llm:
            assert llm.engine.model.cfg.vocab_size == 64
            outs.append(llm.generate([[3, 9, 11]], params)[0].output_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 4


def test_cache_options_name_their_pool_backends_per_caller() -> None:
    """A bad ``swa_pool`` or ``global_pool`` is refused when the engine's settings are made (before the model
    loads), named as the keyword from Python and as the flag on the command line."""
    for kwargs, python, flags in (
        ({"swa_pool": "foo://x"}, "swa_pool: 'foo://x' is not a Redis URL", "--swa-pool: 'foo://x' is not"),
        (
            {"global_pool": "redis://x"},
            "global_pool: 'redis://x' is not a Mooncake URL",
            "--global-pool: 'redis",
        ),
    ):
        with pytest.raises(SettingError) as info:
            LLM("v4.1-micro", cache=CacheOptions(**kwargs))
        assert str(info.value).startswith(python) and info.value.as_flags().startswith(flags)
    with pytest.raises(TypeError, match="swa_pool must be a str"):
        EngineArgs(model="v4.1-micro", cache=CacheOptions(swa_pool=None))


def test_llm_takes_vllms_arguments_at_the_values_that_change_nothing(capsys) -> None:
    """``LLM(..., tensor_parallel_size=1, trust_remote_code=True, enforce_eager=True, dtype="auto")`` runs as
    without them (code written for vLLM spells them out); another value, and ``gpu_memory_utilization`` (the
    KV cache is sized in bytes here), is a TypeError naming it; ``use_tqdm`` is vLLM's name for ``progress``."""
    from kvdiet import SamplingParams

    vllm = {"tensor_parallel_size": 1, "trust_remote_code": True, "enforce_eager": False, "dtype": "float32"}
    params = SamplingParams(max_tokens=3, temperature=0)
    outs = []
    for extra in ({}, vllm):
        with LLM("v4.1-micro", **extra) as llm:
            outs.append(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].output_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 3
    args = EngineArgs(model="v4.1-micro")
    with LLM(args=args, tensor_parallel_size=1) as llm:  # a no-op value is not an individual setting
        assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].output_ids == outs[0]
    refused = {
        "tensor_parallel_size": (2, "LLM accepts vLLM's tensor_parallel_size only as tensor_parallel_size=1"),
        "dtype": ("bfloat16", "LLM accepts vLLM's dtype only as dtype='auto' or dtype='float32'"),
        "trust_remote_code": (1, "trust_remote_code=False or trust_remote_code=True"),
        "gpu_memory_utilization": (0.9, "LLM does not take vLLM's gpu_memory_utilization"),
    }
    for name, (value, words) in refused.items():
        with pytest.raises(TypeError, match="not supported by kvdiet") as info:
            LLM("v4.1-micro", **{name: value})
        assert f"{name}={value!r}" in str(info.value) and words in str(info.value)
    with LLM("v4.1-micro") as llm, pytest.raises(TypeError, match="use_tqdm must be a bool or None"):
        llm.generate([[5]], params, use_tqdm="yes")


def test_a_value_that_looks_like_a_setting_is_echoed_verbatim() -> None:
    """Only the template's own braces name settings: a value (a byte string, a pool URL, a dtype, a device)
    holding ``{max_model_len}`` comes back as it was, from Python and on the command line."""
    exc = SettingError(
        "{persistent_dir=}: got {got}", persistent_dir="/tmp/{block_size}", got="'{max_model_len}'"
    )
    assert str(exc) == "persistent_dir='/tmp/{block_size}': got '{max_model_len}'"
    assert exc.as_flags() == "--persistent-dir /tmp/{block_size}: got '{max_model_len}'"
    cases = (
        (lambda: CacheOptions(kv_cache_memory="{max_model_len}GB"), "kv_cache_memory", "'{max_model_len}GB'"),
        (lambda: CacheOptions(persistent_ttl_s="{block_size}m"), "persistent_ttl_s", "'{block_size}m'"),
        (lambda: EngineArgs(model="v4.1-micro", numerics="{max_model_len}"), "numerics", "'{max_model_len}'"),
        (
            lambda: EngineArgs(model="v4.1-micro", kv_cache_dtype="{numerics=x}"),
            "kv_cache_dtype",
            "'{numerics=x}'",
        ),
        (
            lambda: EngineArgs(model="v4.1-micro", cache=CacheOptions(swa_pool="foo://{max_model_len}")),
            "swa_pool",
            "'foo://{max_model_len}'",
        ),
    )
    for make, name, echoed in cases:
        with pytest.raises(SettingError) as info:
            make()
        said, flags = str(info.value), info.value.as_flags()
        assert said.startswith(name) and echoed in said, said
        assert flags.startswith(flag_name(name)) and echoed in flags, flags


def test_a_request_too_long_for_the_pool_names_both_ways_out_with_their_numbers(monkeypatch) -> None:
    """``LLM("v4-mini")`` without ``max_model_len`` (1,048,576 tokens) does not fit the default 1 GiB pool: the
    refusal gives the ``kv_cache_memory`` that fits it and the ``max_model_len`` the pool fits, and both
    numbers are exact (the one below each is refused, each itself passes)."""
    monkeypatch.setattr("kvdiet.model.build.load_model", _no_load)
    with pytest.raises(SettingError) as info:
        LLM("v4-mini")
    said = str(info.value)
    memory = int(said.split("raise kv_cache_memory to at least ")[1].split(" ")[0])
    most = int(said.rsplit(" ", 1)[1])
    assert "max_model_len 1048576 tokens (the default, max_position_embeddings 1048576) needs 8192" in said
    assert said.endswith(f"or set max_model_len to at most {most}") and most == 305536  # 2387 blocks of 128
    assert info.value.as_flags().endswith(f"or set --max-model-len to at most {most}")
    assert f"raise --kv-cache-memory to at least {memory} bytes" in info.value.as_flags()
    EngineArgs(model="v4-mini", cache=CacheOptions(kv_cache_memory=memory)).validate()
    EngineArgs(model="v4-mini", max_model_len=most).validate()
    for args in (
        EngineArgs(model="v4-mini", cache=CacheOptions(kv_cache_memory=memory - 1)),
        EngineArgs(model="v4-mini", max_model_len=most + 1),
    ):
        with pytest.raises(SettingError, match="needs"):
            args.validate()


def test_numpy_ints_are_taken_as_ints_as_sampling_params_and_max_model_len_take_them() -> None:
    """A size or limit read from a numpy array (``np.int64``) was refused as "must be an int" by `CacheOptions`,
    `SchedulerConfig` and `EngineArgs` (it ran before they checked types); it is kept as Python's int."""
    import numpy as np

    from kvdiet.engine.scheduler import SchedulerConfig

    opts = CacheOptions(kv_cache_memory=np.int64(1 << 20), block_size=np.int64(64), swa_pool_size=np.int32(7))
    got = (opts.kv_cache_memory, opts.block_size, opts.swa_pool_size)
    assert got == (1 << 20, 64, 7) and all(type(v) is int for v in got)
    limits = SchedulerConfig(np.int64(8), np.int64(64))
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (8, 64)
    assert type(limits.max_num_seqs) is int
    args = EngineArgs(model="v4.1-micro", expert_cache_bytes=np.int64(5))
    assert args.expert_cache_bytes == 5 and type(args.expert_cache_bytes) is int
    with pytest.raises(TypeError, match="max_num_seqs must be an int"):
        SchedulerConfig(np.float64(8.0))


def test_a_kv_cache_larger_than_memory_is_refused_before_anything_is_allocated(monkeypatch, capsys) -> None:
    """``--kv-cache-memory 100GB`` on a 24 GB machine filled the pool until the kernel's OOM killer ended it."""
    from kvdiet.model.build import load_model
    from kvdiet.model.memory import InsufficientMemoryError, available_memory_bytes

    monkeypatch.setattr("kvdiet.model.build.load_model", _no_load)
    huge = 10**15  # 1 PB: past any machine's memory
    with pytest.raises(SettingError) as info:
        LLM("v4.1-micro", cache=CacheOptions(kv_cache_memory=huge))
    assert str(info.value).startswith(
        "kv_cache_memory: the KV cache with the model's random weights needs ~1,000,000.0 GB; this machine has "
    )
    assert info.value.as_flags().startswith("--kv-cache-memory: the KV cache with the model's random weights")
    argv = ["serve", "--model", "v4.1-micro", "--port", str(free_port()), "--kv-cache-memory", "1000000GB"]
    assert main([*argv, "--persistent-dir", "none"]) == 2
    assert capsys.readouterr().err.startswith("kvdiet serve: error: --kv-cache-memory: the KV cache with the")
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2", "--kv-cache-memory", "1000000GB"]
    assert main(argv) == 2  # without --max-model-len too (the pool is sized all the same)
    assert capsys.readouterr().err.startswith(
        "kvdiet generate: error: --kv-cache-memory: the KV cache with the"
    )
    # the pool itself checks before it allocates (generate, a model used on its own)
    model, _ = load_model("v4.1-micro")
    blocks = available_memory_bytes() // model.new_pool(1).block_bytes * 2 + 1
    with pytest.raises(InsufficientMemoryError, match=rf"a KV-cache pool of {blocks:,} blocks needs ~"):
        model.new_pool(blocks)
    pool = model.new_pool(1)
    with pytest.raises(InsufficientMemoryError, match=rf"a KV-cache pool grown to {blocks + 1:,} blocks"):
        pool._grow(blocks)
    assert pool.num_blocks == 1  # nothing grown


def test_fp8_numerics_without_a_checkpoint_is_refused(capsys) -> None:
    """Random weights are dense: ``--numerics fp8`` without ``--weights`` ran bf16 and said so only in its table."""
    with pytest.raises(SettingError) as info:
        LLM("v4.1-micro", numerics="fp8")
    assert str(info.value) == "numerics='fp8' goes with weights (random weights are always bf16)"
    assert main(["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2", "--numerics", "fp8"]) == 2
    assert capsys.readouterr().err == (
        "kvdiet generate: error: --numerics fp8 goes with --weights (random weights are always bf16)\n"
    )
    # serve refuses it with its other flags, before the port is bound and before "loading v4.1-micro" is logged
    assert main(["serve", "--model", "v4.1-micro", "--numerics", "fp8", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        "kvdiet serve: error: --numerics fp8 goes with --weights (random weights are always bf16)\n"
    )
    assert "loading" not in err


def test_the_kv_memory_check_counts_the_random_weights(monkeypatch) -> None:
    """``--kv-cache-memory 23.5GB`` with 24.5 GB available passed and ran at a 24.6 GB peak: the weights beside it."""
    from kvdiet.config import load_config
    from kvdiet.model.memory import random_weights_bytes

    weights = random_weights_bytes(load_config("v4.1-mini"))
    monkeypatch.setattr("kvdiet.model.memory.available_memory_bytes", lambda: weights + (2 << 30))
    monkeypatch.setattr("kvdiet.model.build.load_model", _no_load)
    budget = 3 << 30  # fits alone, not with the weights
    with pytest.raises(SettingError, match="the KV cache with the model's random weights needs ~"):
        LLM("v4.1-mini", max_model_len=1024, cache=CacheOptions(kv_cache_memory=budget))
    args = EngineArgs(model="v4.1-mini", max_model_len=1024, cache=CacheOptions(kv_cache_memory=1 << 30))
    args.validate()  # 1 GiB and the weights fit
