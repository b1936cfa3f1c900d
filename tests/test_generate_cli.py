"""`kvdiet generate` with the cache system: a second process hits the first one's persistent tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvdiet.cli import main

PROMPT = ",".join(str(i % 64) for i in range(1, 61))


def _generate(*extra: str) -> dict:
    cmd = [sys.executable, "-m", "kvdiet.cli", "generate", "--model", "v4.1-micro", "--prompt-ids", PROMPT]
    out = subprocess.run(
        [*cmd, "--max-tokens", "3", "--block-size", "4", "--json", *extra],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout)


def test_second_process_gets_a_persistent_hit_and_replays_the_window(tmp_path) -> None:
    first = _generate("--persistent-dir", str(tmp_path))
    second = _generate("--persistent-dir", str(tmp_path))
    assert (
        first["provenance"]["hit_tokens"] == 0 and first["cache_stats"]["persistent"]["entries_written"] == 15
    )
    p = second["provenance"]
    assert (p["persistent_tokens"], p["window_source"], p["replayed_tokens"], p["computed_tokens"]) == (
        56,
        "replay",
        8,
        4,
    )
    assert second["cache_stats"]["persistent"]["hit_tokens"] == 56
    # a snapshot policy persists the window too: a third process restores it exactly
    _generate("--persistent-dir", str(tmp_path), "--swa-policy", "checkpoint:8")
    third = _generate("--persistent-dir", str(tmp_path), "--swa-policy", "checkpoint:8")["provenance"]
    assert (third["window_source"], third["replayed_tokens"], third["exact"]) == ("persistent", 0, True)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--persistent-ttl", "1h"], "--persistent-ttl: no --persistent-dir is given"),
        (["--persistent-size", "1GB"], "--persistent-size: no --persistent-dir is given"),
        (
            ["--persistent-dir", "none", "--persistent-size", "1GB"],
            "--persistent-size: the persistent tier is off (--persistent-dir none)",
        ),
    ],
)
def test_persistent_settings_without_the_tier_are_refused(capsys, flags: list[str], needle: str) -> None:
    """A TTL or size for a persistent tier that is off was ignored without a word (``--persistent-read-only``
    there was already an error): refused, as the global pool's settings without ``--global-pool`` are."""
    assert main(["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"kvdiet generate: error: {needle}\n"


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--swa-policy", "lru", "unknown SWA policy"),
        (
            "--swa-policy",
            "checkpoint:6",
            "--swa-policy: checkpoint period 6 must be a multiple of the block size",
        ),
        ("--persistent-ttl", "soon", "cannot parse duration"),
        ("--persistent-size", "0", "--persistent-size must be > 0 bytes: a tier that keeps nothing is off"),
        ("--kv-cache-memory", "10B", "below one block"),
        ("--block-size", "3", "multiple of every compress ratio"),
        ("--block-size", "0", "multiple of every compress ratio [1, 2]"),
        (
            "--max-tokens",
            "1000000000",
            "max_tokens (1,000,000,000, --max-tokens) = 1,000,000,003 tokens > max_position_embeddings 256",
        ),  # checked before any allocation
        (  # one 4-token block: the pool runs out while decoding
            "--kv-cache-memory",
            "500",
            "the batch needs 1 more block, 0 are free (the KV cache is full: raise --kv-cache-memory)",
        ),
        ("--prompt-ids", "99999999999999999999", "--prompt-ids: token id"),
        ("--prompt-ids", "1,,2", "--prompt-ids: item 2 is empty"),
        ("--prompt-ids", "1,1.5", "--prompt-ids: item 2 ('1.5') is not an integer"),
        ("--prompt-ids", "1_0", "--prompt-ids: item 1 ('1_0') is not an integer"),  # int() reads 10
        ("--prompt-ids", "1," + "9" * 5000, "--prompt-ids: item 2 (999999999999…, 5000 digits) is outside"),
        ("--prompt-ids", "+5,\u0663", "--prompt-ids: item 1 ('+5') is not an integer"),  # and ٣ as 3
        ("--max-tokens", "-1", "--max-tokens: max_tokens must be >= 0"),
        ("--top-p", "2", "--top-p: top_p must be in (0, 1]"),
        ("--chunk-size", "0", "--chunk-size must be >= 1"),
        ("--top-k", "-2", "--top-k: top_k must be >= 1, or 0 or -1 for all tokens"),
        ("--max-model-len", "1000", "--max-model-len must be in [1, 256] (max_position_embeddings)"),
        (
            "--max-model-len",
            "8",
            "prompt (3 tokens) + max_tokens (16, --max-tokens' default) = 19 tokens > max_model_len 8",
        ),
        ("--max-model-len", "1x", "--max-model-len: cannot parse token count"),
        (  # past max_position_embeddings too: the same refusal, not the model's position check
            "--prompt-ids",
            ",".join(["1"] * 257),
            "prompt (257 tokens) + max_tokens (16, --max-tokens' default) = 273 tokens > max_position_embeddings 256",
        ),
    ],
)
def test_bad_cache_flags_exit_2_with_one_line(capsys, tmp_path, flag, value, needle) -> None:
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--block-size", "4"]
    argv += ["--persistent-dir", str(tmp_path), flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_prefill_rate_counts_only_computed_tokens(tmp_path) -> None:
    """Issue 18 point 8: on a hit the rate divides the tokens the prefill computed, never the prompt."""
    _generate("--persistent-dir", str(tmp_path))
    second = _generate("--persistent-dir", str(tmp_path))
    assert "prefill_tokens_per_second" not in second
    assert second["prefill_computed_tokens"] == 8 + 4  # replayed window + the tokens past the hit
    rate = second["prefill_computed_tokens_per_second"]
    assert rate == pytest.approx(12 / second["prefill_seconds"], rel=0.05, abs=0.2)


def test_block_size_is_checked_before_the_model_loads(capsys, monkeypatch, tmp_path) -> None:
    import kvdiet.model.build

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvdiet.model.build, "load_model", no_load)
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--block-size", "3"]
    assert main([*argv, "--persistent-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--block-size: block size 3 must be a positive multiple of every compress ratio [1, 2]" in err
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,x"]  # the ids' syntax too
    assert main([*argv, "--persistent-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "kvdiet generate: error: --prompt-ids: item 2 ('x') is not an integer\n"


def test_progress_lines_when_stderr_is_not_a_terminal(capsys, tmp_path) -> None:
    """Issue 18 point 4: a prefill off a terminal prints lines at a steady pace (here: every chunk)."""
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", PROMPT, "--block-size", "4"]
    argv += ["--chunk-size", "16", "--max-tokens", "1", "--persistent-dir", "none", "--json"]
    assert main([*argv, "--progress-interval", "0"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    done = [int(line.removeprefix("prefill ").split("/")[0]) for line in lines]
    assert len(done) >= 4 and done[0] == 16 and done[-1] == 60 and done == sorted(set(done)), lines
    assert all(line.startswith(f"prefill {n}/60 tokens (") for n, line in zip(done, lines, strict=True))
    assert all("tok/s computed" in line for line in lines)
    # one token: the prefill's; no decode step ran, so no decode rate (was thousands of tok/s: one sampling step)
    assert json.loads(captured.out)["decode_tokens_per_second"] is None  # stdout keeps only the JSON
    assert main([*argv, "--progress-interval", "3600"]) == 0  # a prefill shorter than the pace: no line
    assert capsys.readouterr().err == ""  # (an explicit pace: the default's 10 s is passed by a loaded CI)
    assert main([*argv, "--progress-interval", "-1"]) == 2
    assert "--progress-interval must be >= 0" in capsys.readouterr().err


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path) -> None:
    """Issue 18 point 4: SIGINT during a prefill: ``kvdiet generate: interrupted``, status 130, no traceback."""
    import signal

    cmd = [sys.executable, "-m", "kvdiet.cli", "generate", "--model", "v4.1-micro", "--prompt-ids", PROMPT]
    cmd += ["--block-size", "4", "--chunk-size", "1", "--max-tokens", "150", "--progress-interval", "0"]
    cmd += ["--persistent-dir", str(tmp_path)]
    # the child must not inherit SIGINT ignored (a suite run as a background job without job control starts so,
    # and a handler restored by an earlier test may be SIG_IGN again): a Python handler here is SIG_DFL in it
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        first = proc.stderr.readline()  # the first progress line: the prefill runs
        assert first.startswith("prefill 1/60 tokens"), first + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    rest = [line for line in err.splitlines() if not line.startswith("prefill ")]
    assert proc.returncode == 130, err
    assert rest == ["kvdiet generate: interrupted"] and out == ""


def test_keyboard_interrupt_anywhere_in_a_command_is_one_line(capsys, monkeypatch) -> None:
    import kvdiet.engine.generate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvdiet.engine.generate, "generate_prepared", interrupted)
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--block-size", "4"]
    assert main([*argv, "--persistent-dir", "none"]) == 130
    assert capsys.readouterr().err == "kvdiet generate: interrupted\n"


def test_top_k_and_kv_cache_dtype_reach_the_engine(capsys) -> None:
    """``--top-k 1`` samples the argmax at any temperature; ``--kv-cache-dtype fp32`` stores unquantised caches
    (issue ux41.2: the vLLM flags the engine already has)."""

    def run(*extra: str) -> dict:
        argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", PROMPT, "--block-size", "4"]
        assert main([*argv, "--max-tokens", "6", "--persistent-dir", "none", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    greedy = run("--kv-cache-dtype", "fp32")
    top1 = run("--kv-cache-dtype", "fp32", "--temperature", "1", "--top-k", "1", "--seed", "0")
    packed = run()
    assert top1["output_ids"] == greedy["output_ids"] and len(greedy["output_ids"]) == 6
    assert (greedy["kv_cache_dtype"], packed["kv_cache_dtype"]) == ("fp32", "auto")
    assert greedy["global_kv_bytes"] > 5 * packed["global_kv_bytes"]  # fp32 rows vs FP4/MXFP4 codes


def test_a_missing_prompt_file_is_one_line_naming_the_flag(capsys, tmp_path) -> None:
    argv = ["generate", "--model", "v4.1-micro", "--persistent-dir", "none", "--prompt-file"]
    assert main([*argv, str(tmp_path / "none.txt")]) == 2
    assert capsys.readouterr().err == (
        f"kvdiet generate: error: --prompt-file {tmp_path / 'none.txt'}: no such file or directory\n"
    )
    assert main([*argv, str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"kvdiet generate: error: --prompt-file {tmp_path}: is a directory\n"
    assert main([*argv[:-1], "--prompt-file", ""]) == 2  # not the working directory
    assert capsys.readouterr().err == "kvdiet generate: error: --prompt-file '': no such file or directory\n"
    binary = tmp_path / "binary.txt"  # was run as a prompt of U+FFFD, exit 0
    binary.write_bytes(b"ok \xe3\x28 \xff")
    assert main([*argv, str(binary)]) == 2
    assert capsys.readouterr().err == (
        f"kvdiet generate: error: --prompt-file {binary}: not UTF-8 text (invalid continuation byte at byte 3)\n"
    )
    # a file that never ends read all the memory there was (the kernel killed the process); read to the cap
    assert main([*argv, "/dev/zero", "--max-tokens", "2"]) == 2
    assert capsys.readouterr().err == (
        "kvdiet generate: error: --prompt-file /dev/zero: more than 67,108,864 bytes, the most a text file may "
        "hold here\n"
    )


def test_a_persistent_dir_that_cannot_be_a_folder_is_refused_before_the_model_loads(
    capsys, monkeypatch, tmp_path
) -> None:
    """A given --persistent-dir under a file once turned the tier off with a warning and ran without it."""
    import kvdiet.model.build

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvdiet.model.build, "load_model", no_load)
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--persistent-dir"]
    assert main([*argv, str(afile / "kv")]) == 2
    assert capsys.readouterr().err == (
        f"kvdiet generate: error: --persistent-dir: {str(afile / 'kv')!r} lies under {str(afile)!r}, which is "
        "not a folder\n"
    )
    assert main([*argv, str(afile)]) == 2
    assert (
        capsys.readouterr().err
        == f"kvdiet generate: error: --persistent-dir: {str(afile)!r} is not a folder\n"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]  # nothing made
    if os.path.isdir("/proc/self"):  # a pseudo file system: root passed os.access, then the tier turned off
        assert main([*argv, "/proc"]) == 2
        assert capsys.readouterr().err == (
            "kvdiet generate: error: --persistent-dir: '/proc' is not writable by this process and holds no "
            "persistent tier to read (index.sqlite3)\n"
        )


def test_check_folder_takes_a_folder_to_be_made_and_makes_nothing(tmp_path) -> None:
    from kvdiet.storage.folders import check_folder

    deep = tmp_path / "a" / "b" / "c"
    assert check_folder(str(deep)) == str(deep) and not (tmp_path / "a").exists()
    assert check_folder(str(tmp_path)) == str(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert check_folder(str(locked), writes=False) == str(
            locked
        )  # --persistent-read-only: nothing written
        if os.access(locked, os.W_OK):  # root: permissions are not checked; the mode says nothing
            assert check_folder(str(locked)) == str(locked)
            assert check_folder(str(locked / "kv")) == str(locked / "kv")
        else:
            with pytest.raises(
                ValueError, match=r"is not writable by this process and holds no persistent tier"
            ):
                check_folder(str(locked))
            with pytest.raises(
                ValueError, match=r"cannot be made: its nearest existing part, .* is not writable"
            ):
                check_folder(str(locked / "kv"))
    finally:
        locked.chmod(0o700)
    assert sorted(p.name for p in locked.iterdir()) == []  # the probes were removed
    (locked / "index.sqlite3").write_bytes(b"")
    locked.chmod(0o500)
    try:  # a tier's index in a folder it may not write: opened read-only (the tier decides)
        assert check_folder(str(locked)) == str(locked)
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system (Linux)")
def test_check_folder_refuses_a_pseudo_file_system_even_as_root() -> None:
    """``--persistent-dir /sys/...`` passed as root (``os.access`` grants root everything) and the tier then
    turned itself off with a warning: nothing can be made in /proc or /sys, whoever asks."""
    from kvdiet.storage.folders import check_folder

    with pytest.raises(
        ValueError, match=r"'/proc' is not writable by this process and holds no persistent tier"
    ):
        check_folder("/proc")
    with pytest.raises(
        ValueError, match=r"cannot be made: its nearest existing part, '/proc', is not writable"
    ):
        check_folder("/proc/kvdiet-kv")
    assert check_folder("/proc", writes=False) == "/proc"
