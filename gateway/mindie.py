"""Reads MindIE Service's config.json layout, so a MindIE user brings their file unchanged.

Accepted shapes: the full file (``BackendConfig.ModelDeployConfig``, ``BackendConfig.
ScheduleConfig``, ``ServerConfig``), a fragment holding ``ModelDeployConfig`` at the top level,
or MindIE's documentation snippet as printed (``"ModelDeployConfig" : {...}`` without the outer
braces). Every value is checked by the rules table (gateway/rules.py); a key MindIE does not
define is a warning, one that MindIE defines but pardec does not use is noted at INFO.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace

from pardec.gateway import mindie_keys
from pardec.gateway.rules import CONFIG, Facts, check
from pardec.runtime.draft_params import PARAMS, DraftParams
from pardec.runtime.errors import ConfigError

log = logging.getLogger(__name__)

ASYNC_SCHEDULING_ENV = "MINDIE_ASYNC_SCHEDULING_ENABLE"


@dataclass(frozen=True)
class MindieSettings:
    """A validated config.json; ``facts`` are its raw values as the rules table reads them."""

    facts: Facts = field(default_factory=Facts)
    # Device placement belongs to the verifier's flags (--device); kept for logs and reports.
    world_size: int | None = None
    npu_mem_size: int | None = None
    backend_type: str | None = None

    def __post_init__(self) -> None:
        check(CONFIG, self.facts)

    @property
    def draft(self) -> DraftParams | None:
        f = self.facts
        if not f.parallel:
            return None
        params = {param.name: f.param(param.name) for param in PARAMS}
        return DraftParams(plugin_type=f.plugin_types[0], **params)

    @property
    def max_seq_len(self) -> int:
        return self.facts.max_seq_len

    @property
    def max_input_tokens(self) -> int:
        return self.facts.max_input_tokens

    @property
    def truncation(self) -> bool:
        return self.facts.truncation

    @property
    def speculation_gamma(self) -> int | None:
        return self.facts.speculation_gamma

    @property
    def max_iter_times(self) -> int | None:
        return self.facts.max_iter_times

    @property
    def model_path(self) -> str | None:
        return self.facts.model_path

    @property
    def model_name(self) -> str | None:
        """The served name (ModelConfig[0].modelName); None: the checkpoint's own."""
        return self.facts.model_name

    def named(self, name: str) -> "MindieSettings":
        """These settings serving under ``name`` (pardec up --served-model-name), which wins over
        the config's modelName; checked by the same rule."""
        try:
            return replace(self, facts=replace(self.facts, model_name=name))
        except ConfigError as error:
            raise ConfigError(f"--served-model-name: {error}") from None

    def bounded(self, max_model_len: int, from_file: bool = False) -> "MindieSettings":
        """These settings with ``max_model_len`` positions a sequence (pardec up --max-model-len,
        vLLM's meaning: maxSeqLen, and maxInputTokenLen one less, so a prompt may fill all but the
        answer's first token; a config file's smaller maxInputTokenLen stays), which win over the
        config's; checked by the same rules."""
        if not (isinstance(max_model_len, int) and max_model_len >= 2):
            raise ConfigError(f"--max-model-len: must be an integer >= 2, got {max_model_len}")
        inputs = min(self.max_input_tokens, max_model_len - 1) if from_file else max_model_len - 1
        try:
            return replace(self, facts=replace(self.facts, max_seq_len=max_model_len, max_input_tokens=inputs))
        except ConfigError as error:
            raise ConfigError(f"--max-model-len: {error}") from None

    def serving(self, model_path: str) -> "MindieSettings":
        """These settings serving `model_path` (pardec up --model), which wins over the config's
        ModelConfig[0].modelWeightPath; checked by the same rule."""
        if self.model_path and self.model_path != model_path:
            log.info("--model %s wins over the config's modelWeightPath %s", model_path, self.model_path)
        try:
            return replace(self, facts=replace(self.facts, model_path=model_path))
        except ConfigError as error:
            raise ConfigError(f"--model: {error}") from None

    def gateway_overrides(self) -> dict:
        return {
            "draft": self.draft, "max_input_tokens": self.max_input_tokens, "truncation": self.truncation,
            "speculation_gamma": self.speculation_gamma, "max_iter_times": self.max_iter_times,
        }

    def verifier_overrides(self) -> dict:
        """What the config sets of the verifier's VerifierConfig (None: left to its default)."""
        return {
            "model_path": self.model_path, "served_model_name": self.model_name, "max_seq_len": self.max_seq_len,
            "max_input_tokens": self.max_input_tokens,
        }


def load_mindie_config(path: str | None, environ: dict | None = None) -> MindieSettings:
    """Settings from a config.json; None gives the embedded defaults (memory_decoding, 2560/2048)."""
    environ = os.environ if environ is None else environ
    if path is None:
        return MindieSettings(Facts(async_scheduling=environ.get(ASYNC_SCHEDULING_ENV)))
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ConfigError(f"config {path}: {error}") from error
    return parse_mindie_config(text, path, environ)


def parse_mindie_config(text: str, origin: str = "config.json", environ: dict | None = None) -> MindieSettings:
    environ = os.environ if environ is None else environ
    try:
        document = json.loads(text)
    except json.JSONDecodeError as first_error:
        try:  # MindIE's documentation prints `"ModelDeployConfig" : {...}` without outer braces
            document = json.loads("{" + text.strip().rstrip(",") + "}")
        except json.JSONDecodeError:
            raise ConfigError(f"config {origin}: not JSON ({first_error})") from first_error
    if not isinstance(document, dict):
        raise ConfigError(f"config {origin}: must hold a JSON object")
    backend = _section(document, "BackendConfig", document)
    deploy = _section(backend, "ModelDeployConfig", None)
    if deploy is None:
        raise ConfigError(f"config {origin}: no ModelDeployConfig object (top level or under BackendConfig)")
    schedule = _section(backend, "ScheduleConfig", {})
    server = _section(document, "ServerConfig", {})
    models = deploy.get("ModelConfig") or [{}]
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ConfigError("ModelDeployConfig.ModelConfig: must be a list of objects")
    model = models[0]
    _note_keys(document, backend, deploy, model, schedule, server)
    defaults = Facts()
    facts = Facts(
        plugin_params=model.get("plugin_params"),
        speculation_gamma=deploy.get("speculationGamma"),
        max_seq_len=deploy.get("maxSeqLen", defaults.max_seq_len),
        max_input_tokens=deploy.get("maxInputTokenLen", defaults.max_input_tokens),
        truncation=deploy.get("truncation", False),
        model_count=len(models),
        model_path=model.get("modelWeightPath"),
        model_name=model.get("modelName"),
        lora_modules=deploy.get("LoraModules", backend.get("LoraModules")),
        max_iter_times=schedule.get("maxIterTimes"),
        template_type=schedule.get("templateType", defaults.template_type),
        enable_split=schedule.get("enableSplit", False),
        multi_nodes_infer=backend.get("multiNodesInferEnabled", False),
        infer_mode=server.get("inferMode", server.get("InferMode", defaults.infer_mode)),
        async_scheduling=environ.get(ASYNC_SCHEDULING_ENV),
    )
    settings = MindieSettings(
        facts,
        world_size=model.get("worldSize"),
        npu_mem_size=model.get("npuMemSize"),
        backend_type=model.get("backendType"),
    )
    log.info(
        "config %s: model %s (%s), %s, maxSeqLen %d, maxInputTokenLen %d; worldSize/npuMemSize/backendType "
        "(%s/%s/%s) are MindIE placement settings: pardec runs the model on the verifier's --device",
        origin, settings.model_name, settings.model_path or "bundled default", settings.draft or "plain decoding",
        settings.max_seq_len, settings.max_input_tokens, settings.world_size, settings.npu_mem_size,
        settings.backend_type,
    )
    return settings


def _section(parent: dict, name: str, default):
    value = parent.get(name, default)
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{name}: must be a JSON object, got {type(value).__name__}")
    return value


def _note_keys(document, backend, deploy, model, schedule, server) -> None:
    sections = {
        "config.json": document,
        "ServerConfig": server, "BackendConfig": backend if backend is not document else {},
        "ModelDeployConfig": deploy, "ModelConfig[0]": model, "ScheduleConfig": schedule,
        "LogConfig": document.get("LogConfig") if isinstance(document.get("LogConfig"), dict) else {},
    }
    plugin = model.get("plugin_params")
    if isinstance(plugin, str) and plugin:
        try:
            plugin = json.loads(plugin)
        except json.JSONDecodeError:
            plugin = None  # the rules table reports it
    if isinstance(plugin, dict):
        sections["plugin_params"] = plugin
    unused = []
    for section, values in sections.items():
        known = mindie_keys.KNOWN[section]
        used = mindie_keys.USED.get(section, known if section == "plugin_params" else set())
        for key in sorted(values):
            if key not in known:
                log.warning("%s.%s is not a MindIE config key; ignored (a typo?)", section, key)
            elif key in known and key not in used and not isinstance(values[key], dict):
                unused.append(f"{section}.{key}")
    if unused:
        log.info("MindIE keys pardec does not use (ignored): %s", ", ".join(unused))
