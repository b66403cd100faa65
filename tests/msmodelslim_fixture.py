"""msModelSlim W8A8 checkpoints written by our own code from a tiny transformers model, laid out
as msModelSlim's saver lays them out (see docs/models.md for the format and its sources):

  * weights per-channel symmetric int8 (weight_scale [n, 1], weight_offset zeros [n, 1]);
  * static "W8A8": activations per-tensor asymmetric from calibration (input_scale, input_offset
    [1]), deq_scale = input_scale * weight_scale in fp32 (int64 bits for fp16 models, float32 for
    bf16 ones), quant_bias = round(bias / deq_scale - input_offset * sum_k W[c, k]) in int32;
  * "W8A8_DYNAMIC": weight, weight_scale, weight_offset and the float bias;
  * anti-outlier norm biases: "<norm>.bias" (and, in the older layout, "<norm>.module.*"), the
    following linears' float bias lowered by W @ beta so the function stays the same;
  * FLOAT exceptions (lm_head, chosen linears) stored in the model's dtype;
  * one file `quant_model_weight_<type>.safetensors`, or shards with
    `quant_model_weight_<type>.safetensors.index.json`, and `quant_model_description_<type>.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tests.tiny_checkpoints import write_hf

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


def fp32_bits_as_int64(values: torch.Tensor) -> torch.Tensor:
    """msModelSlim's int64 deq_scale: the fp32 bits read as int32, widened to int64."""
    return torch.from_numpy(np.frombuffer(values.float().numpy().tobytes(), dtype=np.int32).astype(np.int64))


def _calibrate(model, tokens: list[int]) -> dict[str, tuple[float, float]]:
    """(min, max) of every linear layer's input over the calibration tokens."""
    ranges, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(
                lambda _m, inputs, _o, name=name: ranges.__setitem__(
                    name, (float(inputs[0].min()), float(inputs[0].max())))))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return ranges


def write_msmodelslim(model, directory: Path, tokenizer, calibration: list[int], *, scheme: str = "W8A8",
                      dtype: torch.dtype = torch.float16, sharded: bool = False, legacy_norm: bool = False,
                      norm_bias: float = 0.05, float_layers: tuple[str, ...] = ("lm_head",), seed: int = 0) -> Path:
    """The model as msModelSlim would save it quantized (scheme "W8A8" or "W8A8_DYNAMIC")."""
    write_hf(model, directory, tokenizer)
    for file in directory.glob("model*.safetensors*"):
        file.unlink()
    config = json.loads((directory / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config))

    ranges = _calibrate(model, calibration)
    state = {name: tensor.detach().clone().float() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    description = {"model_quant_type": scheme}

    def put(name: str, tensor: torch.Tensor, kind: str) -> None:
        tensors[name], description[name] = tensor.contiguous(), kind

    biases = {}  # linear -> float bias after anti-outlier correction
    for layer in range(model.config.num_hidden_layers):
        for norm, followers in NORMS.items():
            prefix = f"model.layers.{layer}.{norm}"
            beta = norm_bias * torch.randn(model.config.hidden_size, generator=generator) if norm_bias else None
            put(f"{prefix}.weight", state.pop(f"{prefix}.weight").to(dtype), "FLOAT")
            if beta is not None:
                put(f"{prefix}.bias", beta.clone(), "FLOAT")
                if legacy_norm:
                    put(f"{prefix}.module.weight", tensors[f"{prefix}.weight"].clone(), scheme)
                    put(f"{prefix}.module.bias", beta.clone(), scheme)
                for follower in followers:  # the norm's bias, taken back out by the next linear
                    linear = f"model.layers.{layer}.{follower}"
                    bias = state.pop(f"{linear}.bias", torch.zeros(state[f"{linear}.weight"].shape[0]))
                    biases[linear] = bias - state[f"{linear}.weight"].double().matmul(beta.double()).float()
                    low, high = ranges[linear]
                    ranges[linear] = (low - float(beta.abs().max()), high + float(beta.abs().max()))

    for layer in range(model.config.num_hidden_layers):
        for short in LINEARS:
            linear = f"model.layers.{layer}.{short}"
            weight = state.pop(f"{linear}.weight")
            bias = biases.get(linear, state.pop(f"{linear}.bias", None))
            if linear in float_layers or short in float_layers:
                put(f"{linear}.weight", weight.to(dtype), "FLOAT")
                if bias is not None:
                    put(f"{linear}.bias", bias.to(dtype), "FLOAT")
                continue
            weight_scale = (weight.abs().amax(dim=1, keepdim=True) / 127).to(dtype)
            quantized = torch.round(weight / weight_scale.float()).clamp(-127, 127).to(torch.int8)
            put(f"{linear}.weight", quantized, scheme)
            if bias is not None:
                put(f"{linear}.bias", bias.to(dtype), "FLOAT")
            put(f"{linear}.weight_scale", weight_scale, scheme)
            put(f"{linear}.weight_offset", torch.zeros_like(weight_scale), scheme)
            if scheme != "W8A8":
                continue
            low, high = min(ranges[linear][0], 0.0), max(ranges[linear][1], 0.0)
            input_scale = torch.tensor([(high - low) / 255]).to(dtype)
            input_offset = torch.tensor([float(np.clip(round(-128 - low / float(input_scale)), -128, 127))]).to(dtype)
            put(f"{linear}.input_scale", input_scale, scheme)
            put(f"{linear}.input_offset", input_offset, scheme)
            deq_scale = (input_scale.float() * weight_scale.float()).flatten()
            correction = quantized.float().sum(dim=1) * input_offset.float()
            fp_bias = torch.zeros(weight.shape[0]) if bias is None else bias.float()
            put(f"{linear}.quant_bias", torch.round(fp_bias / deq_scale - correction).to(torch.int32), scheme)
            put(f"{linear}.deq_scale", deq_scale if dtype == torch.bfloat16 else fp32_bits_as_int64(deq_scale), scheme)
    for name in list(state):  # embeddings, final norm, lm_head: FLOAT
        put(name, state.pop(name).to(dtype), "FLOAT")
    if norm_bias:
        put("model.norm.bias", norm_bias * torch.randn(model.config.hidden_size, generator=generator), "FLOAT")

    stem = f"quant_model_weight_{scheme.lower()}"
    (directory / f"quant_model_description_{scheme.lower()}.json").write_text(json.dumps(description, indent=2))
    if not sharded:
        save_file(tensors, str(directory / f"{stem}.safetensors"))
        return directory
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for index, part in enumerate(halves, start=1):
        shard = f"{stem}-{index:05d}-of-{len(halves):05d}.safetensors"
        save_file({name: tensors[name] for name in part}, str(directory / shard))
        weight_map |= {name: shard for name in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / f"{stem}.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return directory
