"""Reading the JSON objects of exported folders (torch-free, for the ONNX runtime too)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError


def read_json(path: Path, *, label: str = "", missing_hint: str = "") -> Any:
    """The JSON value in ``path``; a missing file or invalid JSON is a
    :class:`CheckpointError` naming the file (``label`` before it: what the file is;
    ``missing_hint``: what was expected)."""
    if not path.is_file():
        hint = f": {missing_hint}" if missing_hint else ""
        raise CheckpointError(f"{label}{path} does not exist{hint}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{label}{path}: not valid JSON ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{label}{path}: cannot be read ({exc})") from None


def read_json_object(path: Path, *, missing_hint: str = "") -> dict[str, Any]:
    """The JSON object in ``path`` (see :func:`read_json`); another JSON type is a
    :class:`CheckpointError` too."""
    data = read_json(path, missing_hint=missing_hint)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data
