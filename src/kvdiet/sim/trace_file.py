"""Opening a trace file as text, as real trace dumps come: UTF-8 with or without a byte-order mark (what
Windows tools and spreadsheets write first), gzip-compressed or not.

A file whose first two bytes are gzip's magic number (``1f 8b``) is read decompressed, whatever its name. A
byte that is not UTF-8 becomes U+FFFD: the reader then reports the line it is on as malformed (by number)
and reads on, where a decoding error would have stopped the whole trace with no file or line named. This
module knows nothing of trace formats (`kvdiet.sim.traces`, `kvdiet.sim.agentic`).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "GZIP_MAGIC",
    "MAX_LINE_CHARS",
    "SESSION_SUFFIXES",
    "bounded_lines",
    "gzip_errors",
    "open_text",
    "shorten",
]

GZIP_MAGIC = b"\x1f\x8b"
"""The first two bytes of a gzip stream (RFC 1952 §2.3.1)."""
SESSION_SUFFIXES = (".json", ".json.gz")
"""The names of session files (`kvdiet.sim.agentic`), plain or gzip-compressed."""
MAX_LINE_CHARS = 1 << 24
"""The longest line a line-per-record trace may hold (characters): some 16 MB, 30 times a generic line of 1M tokens
at 16 tokens a hash id. A longer one is no trace line (a binary file, or a document that is not one record a line:
``/dev/zero`` read as lines would fill the memory)."""


def open_text(path: Path, *, newline: str | None = None, errors: str = "replace") -> io.TextIOWrapper:
    """``path`` opened for reading text: gzip decompressed when it starts with `GZIP_MAGIC`, decoded as UTF-8
    with a leading byte-order mark dropped and undecodable bytes replaced by U+FFFD (``errors="strict"``:
    a UnicodeDecodeError instead, for a file read whole). The caller closes it (a context manager).
    ``newline``: as `open`'s (``""`` for the csv module).

    Raises:
        OSError: the file cannot be read, or a gzip stream is corrupt (when read: `gzip.BadGzipFile`; data
            that does not inflate raises `zlib.error`; one cut short, EOFError).
    """
    with path.open("rb") as f:
        compressed = f.read(len(GZIP_MAGIC)) == GZIP_MAGIC
    raw = gzip.open(path, "rb") if compressed else path.open("rb")  # noqa: SIM115 (the wrapper owns it)
    return io.TextIOWrapper(raw, encoding="utf-8-sig", errors=errors, newline=newline)


def bounded_lines(
    f: io.TextIOBase, path: Path, error: Callable[[str], Exception]
) -> Iterator[tuple[int, str]]:
    """(line number from 1, text with its newline) of each line of ``f``, each read at most `MAX_LINE_CHARS` + 1
    characters at a time.

    Raises:
        the exception ``error(message)`` makes: a line longer than `MAX_LINE_CHARS` (its first that many
            characters read, no more), the message naming ``path`` and the line.
    """
    n = 0
    while text := f.readline(MAX_LINE_CHARS + 1):
        n += 1
        if len(text) > MAX_LINE_CHARS:
            raise error(
                f"{path}:{n}: a line longer than {MAX_LINE_CHARS:,} characters, over the cap on a trace line "
                "(a binary file, or a document that is not one record a line?)"
            )
        yield n, text


@contextlib.contextmanager
def gzip_errors(path: Path, error: Callable[[str], Exception]) -> Iterator[None]:
    """Inside it, a gzip stream of ``path`` that is cut short or corrupt (raised lazily, as it is read) is
    raised again as ``error(message)``, the message naming ``path``; other exceptions pass through."""
    try:
        yield
    except EOFError:  # the stream stops before its end marker
        raise error(f"{path}: a gzip file cut short (it ends before the stream's end)") from None
    except (gzip.BadGzipFile, zlib.error) as exc:  # a bad header or CRC; deflate data that does not inflate
        raise error(f"{path}: a corrupt gzip file ({exc})") from None


def shorten(value: object) -> str:
    """A value as JSON spells it (``true``, ``null``, ``"16"``, ``Infinity``; Python's ``True`` or ``'16'`` is not
    what the file holds; a value JSON cannot hold: its repr), cut to about 60 characters, for an error line: a wrong
    value may be a whole list of requests, or a JSONL line read as a CSV header (megabytes). A string keeps its
    quotes: its first 60 characters quoted, then ``...``."""
    if isinstance(value, str) and len(value) > 60:
        return json.dumps(value[:60], ensure_ascii=False) + "..."
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."
