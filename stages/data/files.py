"""Reading the user's data files: UTF-8 text and JSON lines, with errors that name the file, the
line and the fix.

Every reader of a user data file (corpus `.txt` and `.jsonl`, SFT `.json` lines) goes through
here, so invalid UTF-8, malformed JSON, a line that is not an object, an empty file and an
unreadable path are reported the same way whichever format or stage meets them. Each function
takes the error class to raise (`CorpusError`, `SftDataError`, ...), so the caller's contract
stays its own. Stdlib only: `stages.data.validate` imports this while Snakemake parses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true/false",
               type(None): "null"}
_BOM = "\ufeff"


def _unreadable(path: Path, e: OSError, error: type[ValueError]) -> ValueError:
    what = "is a directory, not a file" if isinstance(e, IsADirectoryError) else f"cannot be read ({e.strerror})"
    return error(f"{path} {what}; give a readable {path.suffix or 'data'} file")


def decode_utf8(data: bytes, path: str | Path, error: type[ValueError], first_line: int = 1,
                offset: int = 0) -> str:
    """`data` decoded as UTF-8. Invalid UTF-8 raises `error` naming `path:line`, the byte and its
    offset in the file; `data` starts at line `first_line` and file offset `offset`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = e.start
        line = first_line + data.count(b"\n", 0, bad)
        column = bad - (data.rfind(b"\n", 0, bad) + 1) + 1  # 1-based byte of the line
        raise error(f"{path}:{line}: not UTF-8 (byte 0x{data[bad]:02x} at byte {column} of the line, offset "
                    f"{offset + bad} of the file: {e.reason}); convert the file to UTF-8, e.g. "
                    f"`iconv -f latin1 -t utf-8` if it is Latin-1") from None


def read_text(path: str | Path, error: type[ValueError]) -> str:
    """The whole file as UTF-8 text, newlines normalised to "\\n" (as `open(..., 'r')` does)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _unreadable(path, e, error) from None
    return decode_utf8(data, path, error).replace("\r\n", "\n").replace("\r", "\n")


def json_lines(path: str | Path, error: type[ValueError], example: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, decoded object) of every non-blank line of a JSON-lines file (a leading UTF-8
    byte-order mark is allowed). Raises `error` naming `path:line` and showing `example`, a good
    line, when a line is not UTF-8, not JSON or not a JSON object, and naming `path` when the file
    cannot be read or has no line at all."""
    path = Path(path)
    try:
        f = path.open("rb")
    except OSError as e:
        raise _unreadable(path, e, error) from None
    seen, offset = False, 0
    with f:
        for lineno, raw in enumerate(f, start=1):  # lazily: a large corpus file is not held in memory
            line = decode_utf8(raw, path, error, first_line=lineno, offset=offset)
            offset += len(raw)
            if lineno == 1:
                line = line.removeprefix(_BOM)  # Windows editors write one
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                            f"each line must be one JSON object such as {example}") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{lineno}: expected a JSON object, got {_JSON_KINDS.get(type(obj), 'a value')}; "
                            f"each line must be one JSON object such as {example}")
            seen = True
            yield lineno, obj
    if not seen:
        raise error(f"{path}: no JSON lines (the file is empty or blank); "
                    f"expected one JSON object per line such as {example}")
