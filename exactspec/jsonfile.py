"""JSON files of a checkpoint (config.json, tokenizer_config.json, ...): read as one object, or a
CheckpointError naming the file. Used by the model's config and by the tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint file, or CheckpointError naming the file."""
    try:
        v = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(v, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(v).__name__}")
    return v
