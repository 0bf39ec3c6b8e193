"""Reading the JSON objects of exported folders (torch-free, for the ONNX runtime too)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError


def read_json_object(path: Path, *, missing_hint: str = "") -> dict[str, Any]:
    """The JSON object in ``path``; a missing file, invalid JSON or another JSON type is a
    :class:`CheckpointError` naming the file (``missing_hint`` says what was expected)."""
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist{': ' + missing_hint if missing_hint else ''}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data
