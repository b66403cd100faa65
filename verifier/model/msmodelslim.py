"""msModelSlim W8A8 checkpoints (Ascend's quantization tool), used exactly as stored.

A directory with config.json, the tokenizer files, a description `quant_model_description*.json`
(tensor name -> "W8A8" / "W8A8_DYNAMIC" / "FLOAT", plus "model_quant_type" and other global keys)
and its weights: one `quant_model_weight*.safetensors`, or shards `<prefix>-0000i-of-0000n.safetensors`
listed by `<prefix>.safetensors.index.json` ({"metadata": ..., "weight_map": name -> shard}).

Per linear layer, in our names ("layers.0.attention.wq.<field>"):
  * "W8A8" (static): weight int8 [out, in], quant_bias int32 [out], deq_scale fp32 [out] (stored
    int64 for fp16 models: the fp32 bits), input_scale and input_offset [1]; run by
    static_quant.StaticW8A8Linear. Its stored float bias is folded into quant_bias and dropped.
  * "W8A8_DYNAMIC": weight int8, weight_scale [out] (weight_offset must be zero), an optional
    float bias; run by quant.W8A8Linear (per-token dynamic activations), like compressed-tensors.
  * "FLOAT": as stored (in fp32); the verifier's W8A8 quantizes such a layer at load, as it does
    compressed-tensors' unquantized lm_head: exact integer arithmetic needs every layer W8A8.
Anti-outlier smoothing adds a bias after RMSNorm: "<norm>.bias" (older files repeat weight and bias
under "<norm>.module.*", which must then be the same values).

Other schemes (W8A16, W4A8, W8A8S, W8A8_MIX, int8 KV "C8", attention quantization, ...) are
refused with one line naming what. Sources: docs/models.md.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from pardec.runtime.json_files import read_json_object
from pardec.runtime.errors import ConfigError
from pardec.verifier.model.checkpoint import (
    Checkpoint, args_from_config, check_tensors, hf_to_ours, open_safetensors,
)
from pardec.verifier.model.lazy_tensors import LazyTensors
from pardec.verifier.model.static_quant import decode_deq_scale
from pardec.verifier.model.tokenizer import ChatTokenizer

SUPPORTED = ("W8A8", "W8A8_DYNAMIC", "FLOAT")
# Global keys of the description (msModelSlim's AscendV1 format) and what each may hold here.
_GLOBAL_KEYS = ("model_quant_type", "version", "group_size", "metadata", "kv_cache_type", "kv_quant_type",
                "fa_quant_type", "reduce_quant_type", "optional")
_STATIC_FIELDS = ("quant_bias", "deq_scale", "input_scale", "input_offset")
_NORM_NAMES = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}


def description_path(path: str) -> str | None:
    """The description file of an msModelSlim directory, None for any other directory."""
    found = sorted(glob.glob(os.path.join(path, "quant_model_description*.json")))
    if len(found) > 1:
        raise ConfigError(f"{path}: several msModelSlim descriptions ({', '.join(map(os.path.basename, found))})")
    return found[0] if found else None


def _refuse(path: str, what: str) -> None:
    raise ConfigError(f"{path}: msModelSlim {what} is not supported (only W8A8 and W8A8_DYNAMIC linear layers, "
                     f"with FLOAT exceptions)")


def _check_description(description: dict, path: str) -> None:
    model_type = description.get("model_quant_type")
    if model_type not in SUPPORTED:
        _refuse(path, f"model_quant_type {model_type!r}")
    for key in ("kv_cache_type", "kv_quant_type"):
        if description.get(key) not in (None, "", "FLOAT"):
            _refuse(path, f"{key} {description[key]!r} (a quantized KV cache)")
    for key in ("fa_quant_type", "reduce_quant_type"):
        if description.get(key) not in (None, "", "FLOAT"):
            _refuse(path, f"{key} {description[key]!r}")
    if description.get("group_size") not in (None, 0):
        _refuse(path, f"group_size {description['group_size']!r} (per-group weights)")
    if description.get("optional"):
        _refuse(path, "'optional' export (a global rotation applied online)")
    for name, kind in description.items():
        if name not in _GLOBAL_KEYS and kind not in SUPPORTED:
            _refuse(path, f"{kind!r} for {name}")


def _weight_files(path: str) -> list[str]:
    """The safetensors files: every shard an index names, else the single weight file(s)."""
    indexes = sorted(glob.glob(os.path.join(path, "quant_model_weight*.safetensors.index.json")))
    if indexes:
        shards = set()
        for index in indexes:
            with open(index, encoding="utf-8") as f:
                shards |= set(json.load(f)["weight_map"].values())
        missing = [shard for shard in sorted(shards) if not os.path.exists(os.path.join(path, shard))]
        if missing:
            raise ConfigError(f"{path}: shards named by the index are missing: {', '.join(missing)}")
        return [os.path.join(path, shard) for shard in sorted(shards)]
    files = sorted(glob.glob(os.path.join(path, "quant_model_weight*.safetensors")))
    if not files:
        raise ConfigError(f"{path}: an msModelSlim description but no quant_model_weight*.safetensors")
    return files


def _our_name(name: str) -> str | None:
    """Our name for a stored tensor name (a linear's field, a norm's bias), None for others."""
    stem, _, field = name.rpartition(".")
    if field in ("weight", "bias") and stem.endswith(".module"):
        return None  # the older files' repeat of a smoothed norm, compared separately
    if field in ("bias", "weight_scale", "weight_offset", *_STATIC_FIELDS):
        if stem == "model.norm" and field == "bias":
            return "norm.bias"
        norm = stem.rpartition(".")[2]
        if norm in _NORM_NAMES and field == "bias" and stem.startswith("model.layers."):
            return f"layers.{stem.split('.')[2]}.{_NORM_NAMES[norm]}.bias"
        base = hf_to_ours(f"{stem}.weight")
        return None if base is None else f"{base[: -len('.weight')]}.{field}"
    return hf_to_ours(name)


def _read(path: str, description: dict) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, str]]]:
    """Our tensors by name, and where each large one is stored. Vectors (scales, offsets, biases,
    norms) are read now, converted; a matrix (an int8 weight, an embedding, a FLOAT layer) is a
    `meta` tensor of its dtype and shape, with its (file, stored name) in the second dict, read
    only when the model is built from it (`load`), so the int8 model is never held twice."""
    from safetensors import safe_open

    headers = {}  # stored name -> (file, shape, dtype)
    for file in _weight_files(path):
        with open_safetensors(file) as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                headers[name] = (file, tuple(view.get_shape()), view.get_dtype())

    def read(name: str) -> torch.Tensor:
        with safe_open(headers[name][0], framework="pt") as handle:
            return handle.get_tensor(name)

    for name in headers:
        if name.endswith(".kv_cache_scale") or name.endswith(".kv_cache_offset"):
            _refuse(path, f"int8 KV cache ({name})")
    for name in headers:  # older files repeat a smoothed norm under "<norm>.module"
        stem, _, field = name.rpartition(".")
        if stem.endswith(".module") and field in ("weight", "bias"):
            twin = f"{stem[: -len('.module')]}.{field}"
            if twin not in headers or not torch.equal(read(twin).float(), read(name).float()):
                _refuse(path, f"norm {name} differing from {twin}")
    tensors, sources = {}, {}
    for name, (file, shape, dtype) in headers.items():
        ours = _our_name(name)
        if ours is None:
            continue
        field = ours.rpartition(".")[2]
        kind = description.get(f"{name.rpartition('.')[0]}.weight", "FLOAT") if field != "bias" else "FLOAT"
        if field == "weight_offset":
            if bool(read(name).float().any()):
                _refuse(path, f"asymmetric weights ({name} is not zero)")
            continue
        if dtype == "I8" and field == "weight" and kind not in ("W8A8", "W8A8_DYNAMIC"):
            _refuse(path, f"int8 tensor {name} described as {kind!r}")
        if len(shape) >= 2 and field == "weight":
            tensors[ours] = torch.empty(shape, dtype=torch.int8 if dtype == "I8" else torch.float32, device="meta")
            sources[ours] = (file, name)
        elif field == "deq_scale":
            tensors[ours] = decode_deq_scale(read(name), f"{path}: {name}")
        elif field == "weight_scale":
            tensors[ours] = read(name).float().flatten()
        elif field == "quant_bias":
            tensors[ours] = read(name).to(torch.int32).flatten()
        else:
            tensors[ours] = read(name).float()
    return tensors, sources


def _check_layers(tensors: dict[str, torch.Tensor], description: dict, path: str) -> None:
    """Each int8 weight has what its scheme needs; a static layer drops its folded float bias, and
    the dynamic fields of a static layer (weight_scale) are not used."""
    for name in [n for n in tensors if n.endswith(".weight") and tensors[n].dtype == torch.int8]:
        prefix = name[: -len(".weight")]
        out = tensors[name].shape[0]
        if f"{prefix}.deq_scale" in tensors:
            for field in _STATIC_FIELDS:
                if f"{prefix}.{field}" not in tensors:
                    raise ConfigError(f"{path}: static W8A8 layer {prefix} has no {field}")
            for field in ("quant_bias", "deq_scale"):
                if tensors[f"{prefix}.{field}"].numel() != out:
                    raise ConfigError(f"{path}: {prefix}.{field} needs one value per output channel")
            for field in ("input_scale", "input_offset"):
                if tensors[f"{prefix}.{field}"].numel() != 1:
                    raise ConfigError(f"{path}: {prefix}.{field} must be one per-tensor value")
            tensors.pop(f"{prefix}.weight_scale", None)
            tensors.pop(f"{prefix}.bias", None)  # folded into quant_bias by msModelSlim
        elif f"{prefix}.weight_scale" in tensors:
            if tensors[f"{prefix}.weight_scale"].numel() != out:
                raise ConfigError(f"{path}: {prefix}.weight_scale needs one scale per output channel (per-group "
                                 f"weights are not supported)")
        else:
            raise ConfigError(f"{path}: int8 tensor {name} has neither deq_scale (W8A8) nor weight_scale "
                             f"(W8A8_DYNAMIC)")
    for name in [n for n in tensors if n.endswith(".bias") and "norm" in n]:
        if not bool(tensors[name].any()):
            del tensors[name]  # an all-zero anti-outlier bias changes nothing; the fused paths stay open


def load(path: str) -> Checkpoint:
    """An msModelSlim W8A8 directory as a prequantized Checkpoint (nothing re-quantized)."""
    description = read_json_object(description_path(path))
    _check_description(description, path)
    config = read_json_object(os.path.join(path, "config.json"))
    tensors, sources = _read(path, description)
    _check_layers(tensors, description, path)
    # q/k/v biases whether the family has them or anti-outlier smoothing made them, as any layer
    # keeps them: a FLOAT exception (disable_names) or a dynamic layer does, a static layer's are
    # folded into its quant_bias, and zeros stand for them (the static layer adds none).
    parts = tuple(f".attention.{part}.weight" for part in ("wq", "wk", "wv"))
    weights = {name.removesuffix("weight") + "bias": name for name in tensors if name.endswith(parts)}
    qkv_bias = any(bias in tensors for bias in weights)
    if qkv_bias:
        for bias, weight in weights.items():
            tensors.setdefault(bias, torch.zeros(tensors[weight].shape[0]))
    args = args_from_config(config, {name: tuple(t.shape) for name, t in tensors.items()}, path, qkv_bias=qkv_bias)
    if args.tie_embeddings:
        for field in ("weight", "weight_scale", "bias", *_STATIC_FIELDS):
            tensors.pop(f"output.{field}", None)
    check_tensors(args, tensors, path)

    def load(name: str) -> torch.Tensor:
        if name not in sources:
            return tensors[name]
        from safetensors import safe_open

        file, stored = sources[name]
        with safe_open(file, framework="pt") as handle:
            tensor = handle.get_tensor(stored)
        return tensor if tensor.dtype == torch.int8 else tensor.float()

    lazy = LazyTensors({name: tuple(tensor.shape) for name, tensor in tensors.items()}, load)
    return Checkpoint(args, lazy, os.path.basename(os.path.normpath(path)), ChatTokenizer.from_hf_dir(path),
                      prequantized=True)
