"""Reads MindIE Service's config.json layout, so a MindIE user brings their file unchanged.

Accepted shapes: the full file (``BackendConfig.ModelDeployConfig``, ``BackendConfig.
ScheduleConfig``) or a fragment holding ``ModelDeployConfig`` at the top level, as in MindIE's
parallel-decoding examples. Unknown keys are ignored with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from gateway.config import DraftParams
from pardec.errors import ConfigError

log = logging.getLogger(__name__)

_KNOWN_DEPLOY_KEYS = {
    "maxSeqLen", "maxInputTokenLen", "truncation", "speculationGamma", "ModelConfig",
}
_KNOWN_MODEL_KEYS = {
    "plugin_params", "modelInstanceType", "modelName", "modelWeightPath", "worldSize",
    "cpuMemSize", "npuMemSize", "backendType", "trustRemoteCode",
}


@dataclass(frozen=True)
class MindieSettings:
    draft: DraftParams | None = field(default_factory=DraftParams)
    max_seq_len: int = 2560
    max_input_tokens: int = 2048
    truncation: bool = False
    speculation_gamma: int | None = None
    max_iter_times: int | None = None
    model_name: str | None = None
    model_path: str | None = None

    def __post_init__(self) -> None:
        for key, holds, rule in CONFIG_RULES:
            if not holds(self):
                raise ConfigError(f"{key}: {rule}")

    def gateway_overrides(self) -> dict:
        return {"draft": self.draft, "max_input_tokens": self.max_input_tokens, "truncation": self.truncation}

    def verifier_overrides(self) -> dict:
        return {"model_path": self.model_path, "max_seq_len": self.max_seq_len, "max_input_tokens": self.max_input_tokens}


def _gamma_covers_tree(s: MindieSettings) -> bool:
    return s.draft is None or s.speculation_gamma is None or s.speculation_gamma >= s.draft.tokens_per_step


# One row per configuration rule: (key, holds when, the rule in words).
CONFIG_RULES = (
    ("maxInputTokenLen", lambda s: 1 <= s.max_input_tokens < s.max_seq_len, "must be >= 1 and below maxSeqLen"),
    ("speculationGamma", _gamma_covers_tree,
     "must be >= decoding_length for memory_decoding, >= (level-1)*(window+guess_set_size) for la"),
    ("maxIterTimes", lambda s: s.max_iter_times is None or s.max_iter_times >= 1, "must be >= 1"),
    ("modelWeightPath", lambda s: s.model_path is None or os.path.exists(s.model_path),
     "must name an existing model directory or GGUF file"),
)


def load_mindie_config(path: str | None) -> MindieSettings:
    """Settings from a config.json; None gives the embedded defaults."""
    if path is None:
        return MindieSettings()
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"config {path}: {error}") from error
    backend = document.get("BackendConfig", document)
    deploy = backend.get("ModelDeployConfig")
    if not isinstance(deploy, dict):
        raise ConfigError(f"config {path}: no ModelDeployConfig object (top level or under BackendConfig)")
    _warn_unknown("ModelDeployConfig", deploy, _KNOWN_DEPLOY_KEYS)
    models = deploy.get("ModelConfig") or [{}]
    if not isinstance(models, list) or len(models) != 1:
        raise ConfigError("ModelDeployConfig.ModelConfig: must list exactly one model")
    model = models[0]
    _warn_unknown("ModelConfig[0]", model, _KNOWN_MODEL_KEYS)
    schedule = backend.get("ScheduleConfig", {})
    defaults = MindieSettings()
    return MindieSettings(
        draft=_plugin_params(model.get("plugin_params")),
        max_seq_len=int(deploy.get("maxSeqLen", defaults.max_seq_len)),
        max_input_tokens=int(deploy.get("maxInputTokenLen", defaults.max_input_tokens)),
        truncation=bool(deploy.get("truncation", False)),
        speculation_gamma=_optional_int(deploy.get("speculationGamma")),
        max_iter_times=_optional_int(schedule.get("maxIterTimes")),
        model_name=model.get("modelName"),
        model_path=model.get("modelWeightPath"),
    )


def _plugin_params(raw) -> DraftParams | None:
    """plugin_params is a JSON string in MindIE's file; absent means no parallel decoding."""
    if raw is None or raw == "":
        return None
    try:
        params = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except json.JSONDecodeError as error:
        raise ConfigError(f"plugin_params: not valid JSON ({error})") from error
    known = set(DraftParams.__dataclass_fields__)
    _warn_unknown("plugin_params", params, known)
    return DraftParams(**{k: v for k, v in params.items() if k in known})


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _warn_unknown(section: str, values: dict, known: set[str]) -> None:
    for key in sorted(set(values) - known):
        log.warning("%s.%s is not used by pardec; ignored", section, key)
