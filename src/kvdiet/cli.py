"""The ``kvdiet`` command line: wires the sub-commands, each defined beside its package — ``plan``
(`kvdiet.planner.command`: bytes and capacity of a config), ``generate`` (`kvdiet.engine.command`: run the
model on one prompt), ``serve`` (`kvdiet.server.serve`: the OpenAI-compatible server), ``replay``
(`kvdiet.sim.command`: the trace study), ``golden`` (`kvdiet.model.golden`: a reference dump held against
kvdiet), ``fidelity`` (`kvdiet.fidelity.command`) — and turns their errors into one line and an exit status.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import select
import sys
from collections.abc import Collection, Sequence
from typing import NoReturn

from rich.console import Console

from kvdiet import __version__
from kvdiet.cache.block_pool import NoFreeBlocksError
from kvdiet.config import ConfigError
from kvdiet.device import add_device_arg, check_device
from kvdiet.engine.command import add_generate_parser, run_generate
from kvdiet.engine.weights_args import add_numerics_arg
from kvdiet.fidelity.command import add_fidelity_parser, run_fidelity
from kvdiet.planner.command import add_plan_parser, run_plan
from kvdiet.server.serve import add_serve_parser, run_serve
from kvdiet.setting_error import SettingError
from kvdiet.sim.command import add_replay_parser, run_replay
from kvdiet.text_files import read_text
from kvdiet.threads import adaptive_threads, add_threads_arg, bound_spinning, check_threads, set_threads

__all__ = ["ArgumentParser", "main"]

_MAX_FILE_DEPTH = 16  # @FILE inside @FILE: levels read before a loop is assumed


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with the changes every ``kvdiet`` parser gets, sub-commands included (they are made with
    the parent's class), and the benchmark scripts' too:

    - no abbreviated flags: ``--max-num-seq`` is an error, never ``--max-num-seqs`` (``allow_abbrev``);
    - an argument that starts with a dash and a digit is a value, not a flag (argparse only takes
      ``-5`` or ``-0.5`` so), so ``--swa-pool-ttl -5m`` gets the flag's own error ("must be > 0") instead of
      "expected one argument". No ``kvdiet`` flag looks like a negative number;
    - a flag it does not know is the error reported, before a required argument found missing (argparse checks
      those first: ``generate --promt hi`` said "one of the arguments --prompt ... is required"), with the flag
      it comes closest to: ``unrecognized arguments: --promt (did you mean --prompt?)``; one before the command
      (``kvdiet --promt generate``) is the top level's, reported before the command runs. What is a flag follows
      argparse: a dash first, not a negative number, no space (``--model "-my model"`` is a value).
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")
        self._given: list[str] = []  # the arguments of the last parse (a sub-command's: those after its name)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        commands = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        if commands and (early := self._unknown_flags(stop={*commands[0].choices})):
            self.error(f"unrecognized arguments: {' '.join(early)}")  # before the command: not the command's
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        """argparse's error (usage, the message, exit status 2), an unknown flag first (class docstring)."""
        unknown = self._unknown_flags()
        if unknown and "required" in message:  # argparse's missing-argument errors
            message = f"unrecognized arguments: {' '.join(unknown)}"
        if message.startswith("unrecognized arguments:"):  # names compared without their dashes
            known = [flag[2:] for flag in self._option_string_actions if flag.startswith("--")]
            close = [
                f"--{match[0]}"
                for flag in unknown
                if (
                    match := difflib.get_close_matches(
                        flag.split("=", 1)[0].lstrip("-"), known, n=1, cutoff=0.6
                    )
                )
            ]
            if close:
                message += f" (did you mean {', '.join(close)}?)"
        super().error(message)

    def _unknown_flags(self, stop: Collection[str] = ()) -> list[str]:
        """The last parse's arguments that look like flags this parser does not have (``--name`` or
        ``--name=value``), up to ``--``, an ``@FILE`` or an argument in ``stop`` (a command's name)."""
        unknown = []
        for arg in self._given:
            if arg == "--" or arg in stop or (stop and arg[:1] in (self.fromfile_prefix_chars or "")):
                break
            flag = (
                arg[:1] == "-"
                and arg != "-"
                and " " not in arg
                and not self._negative_number_matcher.match(arg)
            )
            if flag and arg.split("=", 1)[0] not in self._option_string_actions:
                unknown.append(arg)
        return unknown

    def _read_args_from_files(
        self, arg_strings: list[str], depth: int = 0, before: list[str] | None = None
    ) -> list[str]:
        """argparse's ``@FILE`` expansion (one argument per line, an ``@FILE`` inside read in turn), each file read
        once through `kvdiet.text_files.read_text`: a file that cannot be read, is not text or never ends
        (``@/dev/zero`` took all the memory) is one line naming it (argparse printed the bare OSError,
        ``[Errno 2] No such file or directory: 'x'``, or a traceback), and so is a file that names itself; the
        line is the command's (``kvdiet generate: error: ...``, with its usage) where one is named before the
        file (``before``: the arguments expanded ahead of ``arg_strings``)."""
        expanded = [] if before is None else before
        for arg in arg_strings:
            if not (arg[:1] and arg[0] in (self.fromfile_prefix_chars or "")):
                expanded.append(arg)
                continue
            if depth >= _MAX_FILE_DEPTH:
                self._command_parser(expanded).error(
                    f"{arg}: @FILE nested more than {_MAX_FILE_DEPTH} deep (a file that names itself?)"
                )
            try:
                text = read_text(arg[1:])
            except ValueError as exc:
                self._command_parser(expanded).error(f"@{exc} (@FILE reads arguments from FILE)")
            lines = [a for line in text.splitlines() for a in self.convert_arg_line_to_args(line)]
            self._read_args_from_files(lines, depth + 1, expanded)
        return expanded

    def _command_parser(self, args: list[str]) -> argparse.ArgumentParser:
        """The parser of the first command named in ``args`` (a sub-command's), else this one."""
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        return next((commands[arg] for arg in args if arg in commands), self)


class _CommandLines(logging.Handler):
    """kvdiet's warnings and errors as one line each on stderr, ``kvdiet generate: warning: persistent tier
    disabled: ...``, as the commands print their own (without it Python's last-resort handler printed the bare
    message); ``sys.stderr`` is looked up at each line, so a redirected stream (a test's capture) is followed."""

    def __init__(self, command: str) -> None:
        super().__init__(logging.WARNING)
        self.command = command

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(
                f"kvdiet {self.command}: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr
            )
        except Exception:  # a closed stream: logging's own report, never an exception in the command
            self.handleError(record)


def _log_lines(command: str) -> None:
    """Install `_CommandLines` on the ``kvdiet`` logger for ``command`` (once: a previous command's is replaced),
    unless that logger has handlers of its own (an embedding program's)."""
    logger = logging.getLogger("kvdiet")
    for handler in [h for h in logger.handlers if isinstance(h, _CommandLines)]:
        logger.removeHandler(handler)
    if not logger.handlers:
        logger.addHandler(_CommandLines(command))


def _build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="kvdiet",
        description="DeepSeek-V4.1-Flash KV-cache system: plan, run and measure it.",
        epilog="Arguments can come from a file, one per line: kvdiet generate @args.txt (e.g. a long "
        "--prompt-ids list).",
        fromfile_prefix_chars="@",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_plan_parser(sub)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_replay_parser(sub)
    _add_golden_parser(sub)
    add_fidelity_parser(sub)
    for name in ("generate", "serve", "replay", "golden", "fidelity"):  # the commands that run the model
        add_threads_arg(sub.choices[name], note="engine mode only" if name == "replay" else "")
    for name in ("generate", "serve", "replay", "golden"):  # fidelity's experiments run on the CPU only
        add_device_arg(sub.choices[name], note="; engine mode only" if name == "replay" else "")
    return parser


def _add_golden_parser(sub: argparse._SubParsersAction) -> None:
    """``kvdiet golden`` (its handler is `kvdiet.model.golden.run_golden_command`; the parser stays here because
    the model package imports nothing from the engine, whose `add_numerics_arg` it uses)."""
    gold = sub.add_parser(
        "golden",
        help="hold a reference dump (checkpoint + reference outputs) against kvdiet",
        description="Load a directory in the shared/golden layout (config.json, safetensors weights in the "
        "released format, reference_outputs.safetensors), run its prompt through kvdiet, feed its decode "
        "tokens, and print how many prompt rows, argmaxes, greedy decode tokens, per-layer top-k sets and "
        "caches agree, and where they first diverge.",
        epilog="examples:\n  kvdiet golden ../shared/golden/tiny-fp8\n"
        "  kvdiet golden ../shared/golden/tiny-fp8 --json\n"
        "  kvdiet golden DIR --numerics bf16 --check     # exit 1 unless the acceptance holds",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    gold.add_argument("directory", help="folder with config.json, weights and reference_outputs.safetensors")
    add_numerics_arg(gold)
    gold.add_argument(
        "--tol",
        type=float,
        default=1e-3,
        help="a row agrees when max|Δlogit| ≤ tol·max|logit| (default 1e-3)",
    )
    gold.add_argument("--json", action="store_true", help="print the report as one JSON object")
    gold.add_argument(
        "--check", action="store_true", help="exit 1 unless the golden README's acceptance holds"
    )


OFF_TERMINAL_WIDTH = 100_000
"""Columns of the console when stdout is a pipe or a file: wider than any table kvdiet prints, so rich
neither wraps nor crops one (a terminal's own width, or COLUMNS, would cut rows short)."""


def _stdout_console() -> Console:
    """The console the commands print to: rich's own on a terminal; off one (a pipe, a file) plain text of
    `OFF_TERMINAL_WIDTH` columns, so every table prints whole."""
    console = Console()
    return console if console.is_terminal else Console(width=OFF_TERMINAL_WIDTH, no_color=True)


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Run one ``kvdiet`` command (``argv``: its arguments, default ``sys.argv[1:]``); returns the exit status
    (2 on bad input). ``own_process``: this process exists for the command (`entry`), so it may re-execute
    itself (`kvdiet replay` on the compiled simulator core); a caller embedding kvdiet keeps False.

    Raises:
        BrokenPipeError: stdout is a pipe whose reader has gone (a broken pipe elsewhere is an error, status 2).
    """
    bound_spinning()  # before anything loads torch (`kvdiet.threads`)
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the sub-command's own usage, not the top level's
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command != "serve":  # serve logs with timestamps (logging.basicConfig there)
        _log_lines(args.command)
    args.own_process = own_process
    console = _stdout_console()
    try:
        if hasattr(args, "threads"):
            check_threads(args.threads)  # in every mode, used or not
        if hasattr(args, "device"):
            check_device(args.device)  # in every mode, before anything loads
            if args.command != "replay" or args.mode == "engine":
                set_threads(args.threads)  # the commands that run the model
            # generate's and serve's engine adapt a default-sized pool (generate's first look spans the model load)
            engine = args.command in ("generate", "serve")
            args.thread_pool = adaptive_threads(args.threads, args.device) if engine else None
        if args.command == "plan":
            run_plan(args, console)
        elif args.command == "generate":
            run_generate(args, console)
        elif args.command == "replay":
            run_replay(args, console)
        elif args.command == "serve":
            run_serve(args)
        elif args.command == "fidelity":
            run_fidelity(args, console)
        elif args.command == "golden":
            from kvdiet.model.golden import run_golden_command  # imports torch: only when it runs

            return run_golden_command(args, console)
    except BrokenPipeError as exc:
        if _stdout_closed():  # stdout's reader went away (``| head``): `entry` exits quietly, not "error"
            raise
        print(f"kvdiet {args.command}: error: {exc}", file=sys.stderr)  # another pipe or socket
        return 2
    except (ConfigError, ValueError, OSError, NoFreeBlocksError) as exc:
        hint = (
            " (the KV cache is full: raise --kv-cache-memory)" if isinstance(exc, NoFreeBlocksError) else ""
        )
        said = exc.as_flags() if isinstance(exc, SettingError) else exc  # flags, not keywords
        print(f"kvdiet {args.command}: error: {said}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C: one line and the shell's status for SIGINT, no traceback
        print(f"kvdiet {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


def entry() -> int:
    """The ``kvdiet`` script (and ``python -m kvdiet.cli``): `main` in a process of its own.

    Output piped into a reader that stops early (``kvdiet replay --json | head -1``) ends the command quietly
    with status 1 instead of a BrokenPipeError traceback: stdout then points at /dev/null so the interpreter's
    final flush cannot fail again (the Python documentation's recipe, "Note on SIGPIPE" in the `signal`
    module; rich's console does the same, status 1, for the text reports); a command that had already failed
    keeps its own status."""
    status = 1
    try:
        status = main(own_process=True)
        sys.stdout.flush()  # output still buffered meets the closed pipe here, inside the try
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return max(status, 1)
    return status


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on it; False where it cannot
    tell)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no file descriptor (a captured stdout)
        return False


if __name__ == "__main__":
    sys.exit(entry())
