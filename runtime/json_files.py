"""A checkpoint's or an operator's JSON file (config.json, tokenizer_config.json, a generation
config, an msModelSlim description) read as a JSON object, or a ConfigError naming the file."""

from __future__ import annotations

import json
import os

from pardec.runtime.errors import ConfigError


def read_json_object(path: str, missing_ok: bool = False) -> dict:
    """The file's JSON object; {} for a missing file where ``missing_ok``."""
    if missing_ok and not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8-sig") as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError) as error:
        raise ConfigError(f"{path}: not a readable JSON file ({str(error)[:200]})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must be a JSON object, not {type(value).__name__}")
    return value
