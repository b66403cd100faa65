"""The sampling a checkpoint recommends in its generation_config.json (Qwen3: temperature 0.6,
top_p 0.95, top_k 20), served as the defaults of HTTP requests that leave those fields out, as
vLLM's `--generation-config auto` serves them; its max_new_tokens, as vLLM reads it too, is both
the default and the cap of the tokens an HTTP request generates. Only these fields are read; the
rest of the file (its end-of-sequence ids) is the tokenizer's business. A checkpoint without the
file gives what its config.json says of them where it differs from transformers' own defaults,
as vLLM falls back to it under transformers 4 (an older model's config.json carried its sampling);
a value out of range there is left out with a warning, as no server read it before.

    >>> defaults_of({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": 2}, "g")
    (('temperature', 0.6), ('top_k', 20), ('top_p', 0.95))
    >>> defaults_of({"max_new_tokens": 2048, "max_length": 20}, "g")  # max_length is transformers' alone
    (('max_new_tokens', 2048),)
    >>> defaults_of({"temperature": -1}, "g")
    Traceback (most recent call last):
    ...
    pardec.runtime.errors.ConfigError: g: temperature: -1 must be a number in [0, 3e+38]
"""

from __future__ import annotations

import logging
import math
import os

from pardec.runtime.json_files import read_json_object
from pardec.runtime.errors import ConfigError
from pardec.verifier.api import MIN_TEMPERATURE

log = logging.getLogger(__name__)

SETTINGS = ("auto", "none", "vllm")  # besides a directory holding a generation_config.json; "vllm": vLLM's "none"
FILE = "generation_config.json"
# Each field a default may set: its type and bounds (a request's own rules, openai_api.py).
FIELDS = {"temperature": (float, 0.0, 3.0e38), "top_p": (float, 0.0, 1.0), "top_k": (int, -1, 2**31 - 1),
          "min_p": (float, 0.0, 1.0), "repetition_penalty": (float, 1e-6, 3.0e38),
          "max_new_tokens": (int, 1, 2**31 - 1)}

GenerationDefaults = tuple[tuple[str, float], ...]  # (field, value) pairs, by field name
MODEL_FILE = "config.json"
# transformers' GenerationConfig defaults: a config.json stating one of them says nothing.
TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def check_setting(setting: str) -> None:
    """"auto", "none" (or vLLM's spelling of it, "vllm"), or a directory that holds a generation_config.json."""
    if setting not in SETTINGS and not os.path.isfile(os.path.join(setting, FILE)):
        raise ConfigError(f"generation_config: {setting[:200]!r} must be auto, none, or a directory holding {FILE}")


def generation_defaults(setting: str, model_path: str | None) -> GenerationDefaults:
    """The defaults ``setting`` names: "auto", the model directory's file where it has one, else
    its config.json's differences from transformers' defaults (a GGUF file has none); "none",
    none; else the file in that directory."""
    check_setting(setting)
    if setting in ("none", "vllm"):
        return ()
    directory = model_path if setting == "auto" else setting
    if not directory or not os.path.isdir(directory):
        return ()
    path = os.path.join(directory, FILE)
    if not os.path.isfile(path):
        model = os.path.join(directory, MODEL_FILE)
        if not os.path.isfile(model):
            return ()
        stated = []  # each field on its own: one a server never read before does not stop its start
        for name, value in read_json_object(model).items():
            if name in FIELDS and value is not None and TRANSFORMERS_DEFAULTS.get(name) != value:
                try:
                    stated += defaults_of({name: value}, model)
                except ConfigError as error:
                    log.warning("%s; left out of the default sampling", error)
        return tuple(sorted(stated))
    return defaults_of(read_json_object(path), path)


def defaults_of(config: dict, path: str) -> GenerationDefaults:
    """The sampling fields a generation config sets (null ones left out), each checked."""
    found = []
    for name, (kind, low, high) in sorted(FIELDS.items()):
        value = config.get(name)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (kind is int and value != int(value)) or not low <= value <= high:
            kind_name = "an integer" if kind is int else "a number"
            raise ConfigError(f"{path}: {name}: {value!r:.40} must be {kind_name} in [{low:g}, {high:g}]")
        if name == "temperature" and 0 < value < MIN_TEMPERATURE:  # as every request's (verifier/api.py)
            raise ConfigError(f"{path}: temperature: {value!r:.40} must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        found.append((name, kind(value)))
    return tuple(found)
