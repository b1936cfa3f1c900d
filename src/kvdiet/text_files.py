"""`read_text`: a UTF-8 text file a user names (a prompt file, an ``@FILE`` of arguments, fidelity's prompts), read
whole up to `MAX_TEXT_BYTES`, each fault one line that starts with the path.

A path may name what never ends (``/dev/zero``, a pipe that keeps writing): read without a bound, it took all the
machine's memory before the kernel killed the process. A prompt of a million tokens is some 4 MB of text (7 MB as
token ids); 64 MiB is far past any prompt the models here take, and far below what a machine can hold.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["MAX_TEXT_BYTES", "read_text"]

MAX_TEXT_BYTES = 64 << 20


def read_text(path: str | Path, *, cap: int = MAX_TEXT_BYTES) -> str:
    """The text of ``path``, read once (a pipe is read as it comes), with universal newlines (``\\r\\n`` and
    ``\\r`` read as ``\\n``, as `pathlib.Path.read_text` reads them) and without a leading byte-order mark
    (U+FEFF, as Windows editors save UTF-8: it is no part of the text, and would be a prompt's first token or
    part of an ``@FILE``'s first argument).

    Raises:
        ValueError: one line that starts with ``path``: the system's reason in lower case (``no such file or
            directory``, ``is a directory``, ``permission denied``), ``not UTF-8 text (REASON at byte N)``, or
            ``more than 67,108,864 bytes, ...`` (read no further than that).
    """
    if str(path) == "":  # Path("") is the working directory: name the empty path instead
        raise ValueError("'': no such file or directory")
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError as exc:  # "[Errno 2] No such file or directory: 'x'" → "x: no such file or directory"
        raise ValueError(f"{path}: {(exc.strerror or str(exc)).lower()}") from None
    if len(data) > cap:
        raise ValueError(f"{path}: more than {cap:,} bytes, the most a text file may hold here")
    try:
        text = data.decode("utf-8-sig")  # utf-8, a leading byte-order mark dropped
    except UnicodeDecodeError as exc:  # a binary file: refused, not read as text of U+FFFD
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")
