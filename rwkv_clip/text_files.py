"""Reading caption files: one rule for a text file that is not in its encoding and for an
empty caption, shared by every reader of captions (make_rec's pairs, the retrieval sets'
JSONL / JSON / Urban1k caption files, the long-caption groups).

A byte that is not valid in the file's encoding is a :class:`~rwkv_clip.errors.DataError`
naming the file and line, with the hint to give the encoding (``--encoding``); a caption
that is empty or only whitespace is :data:`EMPTY_CAPTION`: an evaluation reader stops on
it (a benchmark with a caption left out is another benchmark), a training-data converter
skips the pair and counts it under this reason.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from .errors import DataError

ENCODING_HINT = "give the file's encoding with --encoding"
EMPTY_CAPTION = "empty caption"


def check_encoding(encoding: str, path: str | os.PathLike | None = None) -> None:
    """A :class:`DataError` for an encoding name Python does not know."""
    try:
        "".encode(encoding)
    except LookupError:
        raise DataError(f"unknown text encoding {encoding!r}",
                        None if path is None else str(path)) from None


def _bad_bytes(exc: UnicodeDecodeError, encoding: str, lineno: int, start: int,
               where: str, hint: str) -> DataError:
    return DataError(f"line {lineno} is not valid {encoding} text ({exc.reason} at byte "
                     f"{exc.start - start} of the line); {hint}", f"{where}:{lineno}")


def text_lines(lines: Iterable[bytes], path: str | os.PathLike, encoding: str = "utf-8",
               hint: str = ENCODING_HINT) -> Iterator[str]:
    """Decode a binary file line by line, so a bad byte is reported with its line."""
    for lineno, raw in enumerate(lines, 1):
        try:
            yield raw.decode(encoding)
        except UnicodeDecodeError as exc:
            raise _bad_bytes(exc, encoding, lineno, 0, str(path), hint) from None


def read_text(path: str | os.PathLike, encoding: str = "utf-8",
              hint: str = ENCODING_HINT) -> str:
    """The whole text of ``path``; a byte not valid in ``encoding`` is a :class:`DataError`
    naming the file and line (``hint``: what the user can do about it)."""
    check_encoding(encoding, path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        start = data.rfind(b"\n", 0, exc.start) + 1
        raise _bad_bytes(exc, encoding, lineno, start, str(path), hint) from None


def is_empty_caption(text: object) -> bool:
    """A caption that is missing, not a string, or only whitespace."""
    return not isinstance(text, str) or not text.strip()


def check_caption(text: object, where: str) -> str:
    """``text`` stripped; an empty caption is a :class:`DataError` naming ``where`` (the
    file and line or entry)."""
    if is_empty_caption(text):
        raise DataError(f"{EMPTY_CAPTION} (every caption needs text)", where)
    return str(text).strip()


__all__ = ["ENCODING_HINT", "EMPTY_CAPTION", "check_encoding", "text_lines", "read_text",
           "is_empty_caption", "check_caption"]
