"""Every ``kvdiet`` parser, sub-commands included: ``--version``, no abbreviated flags, values that start with
a dash and a digit, help text on every flag (issue 18 points 3 and 6)."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import kvdiet
from kvdiet.cli import _build_parser, main


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: p for action in actions for name, p in action.choices.items()}


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    top = _build_parser()
    return {"kvdiet": top} | {f"kvdiet {name}": p for name, p in _subparsers(top).items()}


def test_version_is_the_package_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvdiet.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout == f"kvdiet {kvdiet.__version__}\n"
    assert kvdiet.__version__ == importlib.metadata.version("kvdiet")


def test_every_parser_refuses_abbreviations() -> None:
    parsers = _all_parsers()
    assert {"kvdiet plan", "kvdiet generate", "kvdiet serve", "kvdiet replay"} <= set(parsers)
    for name, parser in parsers.items():
        assert parser.allow_abbrev is False, name


@pytest.mark.parametrize(
    ("argv", "abbreviated"),
    [  # each would also fail fast if the abbreviation were taken (bad port, model or trace): no real run
        (["plan", "--jso"], "--jso"),
        (["serve", "--max-num-seq", "4", "--port", "-1"], "--max-num-seq"),
        (["generate", "--model", "no-such-model", "--prompt-ids", "1,2", "--max-tok", "3"], "--max-tok"),
        (["replay", "no-such-trace.jsonl", "--max-req", "3"], "--max-req"),
    ],
)
def test_an_abbreviated_flag_is_an_error(capsys, argv: list[str], abbreviated: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"kvdiet {argv[0]}: error: unrecognized arguments: {abbreviated}" in err  # the sub-command's
    assert f"usage: kvdiet {argv[0]}" in err  # own usage, not the top level's


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--swa-pool-ttl", "-5m"], "--swa-pool-ttl: duration must be > 0 and finite, got '-5m'"),
        (["--persistent-ttl", "-1h"], "--persistent-ttl: duration must be > 0 and finite, got '-1h'"),
        (["--kv-cache-memory", "-1GiB"], "--kv-cache-memory: "),
    ],
)
def test_a_negative_value_gets_the_flags_own_error(capsys, argv: list[str], message: str) -> None:
    """``--swa-pool-ttl -5m`` once got argparse's "expected one argument"."""
    base = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--block-size", "4"]
    assert main([*base, "--persistent-dir", "none", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "expected one argument" not in err and err.count("\n") == 1


def test_an_unreadable_args_file_and_misnamed_flags_are_one_line(tmp_path: Path, capsys) -> None:
    """``@FILE`` that is missing or binary (argparse printed ``[Errno 2] No such file or directory: 'x'``), a file
    given for golden's folder, and values of golden's and fidelity's flags named as the flags."""
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\xff\xfe\x00" * 10)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "a.txt").write_text("some text to read")
    looped = tmp_path / "looped.txt"
    looped.write_text(f"--max-tokens\n3\n@{looped}\n")
    cases = [
        (
            ["generate", f"@{tmp_path / 'none.txt'}"],
            f"kvdiet generate: error: @{tmp_path / 'none.txt'}: no such file",
        ),
        (
            ["generate", f"@{binary}"],
            f"kvdiet generate: error: @{binary}: not UTF-8 text (invalid start byte at byte 0)",
        ),
        # one that never ends (all the memory went), one that names itself (a RecursionError traceback)
        (
            ["generate", "@/dev/zero"],
            "kvdiet generate: error: @/dev/zero: more than 67,108,864 bytes, the most a text file",
        ),
        (["generate", f"@{looped}"], f"kvdiet generate: error: @{looped}: @FILE nested more than 16 deep"),
        # a file named before any command: the top-level parser's line
        ([f"@{tmp_path / 'none.txt'}"], f"kvdiet: error: @{tmp_path / 'none.txt'}: no such file"),
        (["golden", str(binary)], f"kvdiet golden: error: {binary}: a file, not a folder"),
        # an empty path read as the working folder ("no reference_outputs.safetensors in .")
        (["golden", ""], "kvdiet golden: error: the golden folder's path is empty"),
        (
            ["golden", str(tmp_path), "--tol", "nan"],
            "kvdiet golden: error: --tol must be a finite number > 0",
        ),
        (
            ["fidelity", "--prompts", str(prompts), "--hits", "-1"],
            "kvdiet fidelity: error: --hits: token count must be >= 0, got '-1'",
        ),
        (
            ["fidelity", "--prompts", str(prompts), "--chunk", "x"],
            "kvdiet fidelity: error: --chunk: cannot parse",
        ),
        (
            ["fidelity", "--prompts", str(prompts), "--report", str(binary)],
            f"kvdiet fidelity: error: --report {binary}: a file is in the way (a folder is needed)",
        ),
        # a mistyped report path makes no tree of folders; a missing checkpoint is named as missing
        (
            ["fidelity", "--prompts", str(prompts), "--report", str(tmp_path / "typo" / "out")],
            f"kvdiet fidelity: error: --report {tmp_path / 'typo' / 'out'}: {tmp_path / 'typo'} does not exist",
        ),
        (
            ["generate", "--weights", str(tmp_path / "absent"), "--prompt", "hi"],
            f"kvdiet generate: error: --weights {tmp_path / 'absent'}: no such file or folder",
        ),
    ]
    for argv, message in cases:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors (the @FILE expansion) exit
            code = exc.code
        assert code == 2, argv
        err = capsys.readouterr().err
        assert err.splitlines()[-1].startswith(message), (argv, err)
        assert "Traceback" not in err and "Errno" not in err
    assert not (tmp_path / "typo").exists()


def test_a_ttl_flag_takes_its_unit_in_any_case_but_refuses_a_capital_m(capsys) -> None:
    """``--persistent-ttl 72H`` is 72 hours, as ``--kv-cache-memory 8gb`` is 8 GB; ``72M`` (minutes or
    months?) is refused by the flag, in one line, before anything runs."""
    from kvdiet.cache.options import CacheOptions

    opts = CacheOptions(persistent_ttl_s="72H", swa_pool_ttl_s="5MIN", global_pool_ttl_s="1D")
    ttls = (opts.persistent_ttl_s, opts.swa_pool_ttl_s, opts.global_pool_ttl_s)
    assert ttls == (259_200.0, 300.0, 86_400.0)
    base = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--persistent-dir", "none"]
    assert main([*base, "--persistent-ttl", "72M"]) == 2
    err = capsys.readouterr().err
    assert "--persistent-ttl: duration '72M': 'M' is ambiguous (minutes or months?)" in err
    assert err.count("\n") == 1


def test_every_flag_has_help() -> None:
    for name, parser in _all_parsers().items():
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.help, f"{name} {action.option_strings[0]} has no help text"


@pytest.mark.parametrize("flags", [["--json"], []])
def test_a_reader_that_stops_early_ends_the_command_quietly(flags: list[str]) -> None:
    """Issue ux41.7: ``kvdiet plan --json | head -c 10``: status 1 and nothing on stderr (no BrokenPipeError
    traceback, no "error: Broken pipe"). The pipe is one page, so the report (over 5 kB) meets it closed."""
    import fcntl
    import os

    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    cmd = [sys.executable, "-m", "kvdiet.cli", "plan", *flags]
    proc = subprocess.Popen(cmd, stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    assert len(os.read(read_end, 10)) == 10  # one raw read: the writer stays blocked on the full page
    os.close(read_end)
    err = proc.communicate(timeout=60)[1]
    assert (proc.returncode, err) == (1, "")


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys) -> None:
    """A BrokenPipeError from another pipe or socket (stdout still open) is reported like any other I/O error,
    status 2, not taken for a reader of stdout that stopped early."""
    from kvdiet import cli

    def broken(args, console):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "run_plan", broken)
    assert cli.main(["plan"]) == 2
    assert capsys.readouterr().err == "kvdiet plan: error: [Errno 32] Broken pipe\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [  # each also misses a required argument, which argparse reported instead of the mistyped flag
        (["generate", "--promt", "hi"], "unrecognized arguments: --promt (did you mean --prompt?)"),
        (["replay", "--mod", "engine"], "unrecognized arguments: --mod (did you mean --mode?)"),
        (["fidelity", "--promps=x.txt"], "unrecognized arguments: --promps=x.txt (did you mean --prompts?)"),
        # no required argument missing: argparse's own listing (values included), the suggestion added
        (["plan", "--jsn"], "unrecognized arguments: --jsn (did you mean --json?)"),
        (["plan", "--no-such-flag-at-all"], "unrecognized arguments: --no-such-flag-at-all"),
        # names compared without their dashes: '--foo' came closest to '--tol' by its two dashes alone
        (["golden", "--foo"], "unrecognized arguments: --foo"),
        (["fidelity", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_mistyped_flag_is_the_error_named(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"kvdiet {argv[0]}: error: {message}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [  # before the command: the top level's flags (were reported as the command's, or its missing prompt)
        (["--promt", "generate"], "kvdiet: error: unrecognized arguments: --promt"),
        (["--verbose", "plan"], "kvdiet: error: unrecognized arguments: --verbose"),
        # a value with a space is no flag (argparse's rule): the missing argument is the error
        (
            ["generate", "--model", "-my model"],
            "kvdiet generate: error: one of the arguments --prompt --prompt-file --prompt-ids is required",
        ),
        (["replay", "--runs", "-a b"], "kvdiet replay: error: the following arguments are required: trace"),
    ],
)
def test_what_is_a_flag_follows_argparse(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == message


def test_a_missing_argument_is_still_named_without_a_mistyped_flag(capsys) -> None:
    # a value that looks like a negative number and anything after -- are no flags
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--max-tokens", "-5", "--", "--not-a-flag"])
    assert exc.value.code == 2
    assert "one of the arguments --prompt --prompt-file --prompt-ids is required" in capsys.readouterr().err


def test_a_byte_order_mark_is_no_part_of_a_text_file(capsys, tmp_path) -> None:
    """A UTF-8 file saved with a byte-order mark (Windows editors) gave a prompt an extra first token, and an
    ``@FILE`` a first argument '\\ufeff--flag' that no parser knows."""
    from kvdiet.text_files import read_text

    marked = tmp_path / "bom.txt"
    marked.write_bytes(b"\xef\xbb\xbfhello\r\nworld\xef\xbb\xbf")
    assert read_text(marked) == "hello\nworld\ufeff"  # only the leading mark is dropped
    args = tmp_path / "args.txt"
    args.write_bytes("\ufeff--json\n".encode())
    assert main(["plan", f"@{args}", "--context", "0"]) == 2  # --json taken: --context's own error follows
    assert capsys.readouterr().err == "kvdiet plan: error: --context must be > 0, got 0\n"
