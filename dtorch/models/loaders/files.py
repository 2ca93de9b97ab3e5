"""Model files are untrusted: each is checked to be a regular file before it is opened (a FIFO would block the
open forever, a device such as /dev/zero never ends), JSON is read with a size bound and a nesting bound, and a
file an index names must lie inside the model directory."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from dtorch.core.errors import ModelError

MAX_JSON_BYTES = 256 << 20  # config, index and tokenizer configs are kilobytes; tokenizer.json some tens of MB

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def regular_file(path: str | Path, what: str) -> Path:
    """``path`` when it is a regular file (a symlink to one counts: the Hugging Face cache links its blobs), checked
    with ``stat`` before anything opens it. Raises ``ModelError`` naming ``path``, ``what`` was expected (e.g. "the
    model's config.json") and what is there instead."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file; expected {what}") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot be read ({e.strerror}); expected {what}") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise ModelError(f"{path}: is {kind}, not a regular file; expected {what}")
    return path


def read_json(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in regular file ``path`` (at most ``MAX_JSON_BYTES``). Malformed JSON, invalid UTF-8, a
    nesting bomb (``[[[[...]]]]``, which ``json.loads`` answers with RecursionError) or a non-object raise
    ``ModelError`` naming the file."""
    path = regular_file(path, what)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ModelError(f"{path}: is {size} bytes; expected {what} of at most {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read JSON ({e}); expected {what}") from None
    except RecursionError:
        raise ModelError(f"{path}: its JSON is nested too deeply to read; expected {what}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object ({what}), got {type(data).__name__}")
    return data


def inside(directory: Path, name: object, source: Path, field: str) -> Path:
    """``directory / name`` for a file name read from ``source``'s ``field``, refused unless it is a relative path
    that stays inside ``directory`` (no ``..`` part, not absolute: ``/dev/zero``, ``C:\\x``, ``../other/x`` are
    refused). Checked on the name, not the resolved path: the Hugging Face cache links each file to a blob outside
    the snapshot directory."""
    if not isinstance(name, str) or not name:
        raise ModelError(f"{source}: {field} names {name!r}; expected a file name inside {directory}")
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or ".." in posix.parts or ".." in windows.parts:
        raise ModelError(f"{source}: {field} names {name!r}, which is outside the model directory {directory}; "
                         "expected a relative file name inside it (e.g. model-00001-of-00002.safetensors)")
    return directory / posix
