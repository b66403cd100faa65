"""What every checkpoint loader shares: the Checkpoint it returns, Hugging Face's tensor names
in ours, the model's shape from a config.json with the checks a family needs, and the check of
every tensor's shape against it. weights.py reads GGUF files and Hugging Face directories with
it, msmodelslim.py Ascend's W8A8 directories."""

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pardec.runtime.errors import ConfigError
from pardec.runtime.architectures import WITH_QK_NORM, WITH_QKV_BIAS
from pardec.verifier.model.args import ROPE_KINDS, SUPPORTED_ARCHITECTURES, ModelArgs, RopeScaling
from pardec.verifier.model.lazy_tensors import shape_of
from pardec.verifier.model.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

HF_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}


@dataclass(frozen=True)
class Checkpoint:
    args: ModelArgs
    # gpt-fast names ("layers.0.attention.wq.weight", ...), read when asked for (LazyTensors), fp32;
    # in a prequantized checkpoint the linear weights are int8 with their scales next to them.
    tensors: Mapping[str, torch.Tensor]
    model_name: str
    tokenizer: ChatTokenizer
    prequantized: bool = False
    # The file or directory it was read from ("" when made in memory): the prepared-weight
    # cache's key starts from it (prepare/cache.py).
    source: str = ""


def rename(name: str, names: dict[str, str], layer_names: dict[str, str], layer_prefix: str) -> str | None:
    """Our name for a stored one: `names` for whole-model tensors, `layer_names` after "<prefix><i>."."""
    if name in names:
        return names[name]
    if name.startswith(layer_prefix):
        layer, _, rest = name[len(layer_prefix) :].partition(".")
        if rest in layer_names:
            return f"layers.{layer}.{layer_names[rest]}"
    return None


def open_safetensors(shard: str):
    """A safetensors file opened for its header; ConfigError naming it where the header does not
    read (a truncated download), which safetensors' own error does not."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(shard, framework="pt")
    except (SafetensorError, OSError) as error:
        raise ConfigError(f"{shard}: not a readable safetensors file ({error})") from None


def hf_to_ours(name: str) -> str | None:
    """Our name for a Hugging Face tensor name, None for a tensor the model does not use."""
    return rename(name, HF_NAMES, HF_LAYER_NAMES, "model.layers.")


def config_architecture(config: dict, path: str) -> str:
    """The family a config.json names, after refusing what no family here has, naming it."""
    architecture = config.get("model_type") or (config.get("architectures") or ["<none>"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {architecture!r} in {path}; supported: {SUPPORTED_ARCHITECTURES}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ConfigError(f"{path}: attention_bias / mlp_bias: biases on o_proj or the MLP are not supported")
    if config.get("use_sliding_window"):
        raise ConfigError(f"{path}: sliding-window attention is not supported")
    return architecture


def args_from_config(config: dict, shapes: Mapping[str, tuple[int, ...]], path: str,
                     qkv_bias: bool | None = None) -> ModelArgs:
    """The model's shape from a config.json and its tensors' shapes (our names); qkv_bias None:
    the family's."""
    architecture = config_architecture(config, path)
    rope = config.get("rope_parameters") or {}  # transformers 5 nests rope settings here
    for key, value in (("rope_parameters", rope), ("rope_scaling", config.get("rope_scaling") or {})):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: config.json's {key} must be an object, got {value!r}")
    scaling = rope_scaling(config.get("rope_scaling") or rope, path)
    if "tok_embeddings.weight" not in shapes:
        raise ConfigError(f"{path}: missing tensor tok_embeddings.weight (model.embed_tokens.weight)")

    def number(key: str, default: float | None = None, kind: type = int, stated: dict = config):
        value = stated.get(key, default)
        if value is None:
            raise ConfigError(f"{path}: config.json has no {key}")
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise ConfigError(f"{path}: config.json's {key} must be {'a number' if kind is float else 'an integer'}, "
                              f"got {value!r}")
        return kind(value)

    n_heads = number("num_attention_heads")
    return ModelArgs(
        architecture=architecture,
        vocab_size=shapes["tok_embeddings.weight"][0],
        dim=number("hidden_size"),
        n_layers=number("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=number("num_key_value_heads", None) if config.get("num_key_value_heads") else n_heads,
        ffn_dim=number("intermediate_size"),
        rope_theta=number("rope_theta", number("rope_theta", 10000.0, float), float, rope),
        norm_eps=number("rms_norm_eps", 1e-6, float),  # transformers' default for every family here
        max_position=served_positions(number("max_position_embeddings"), scaling),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)) or "output.weight" not in shapes,
        qkv_bias=architecture in WITH_QKV_BIAS if qkv_bias is None else qkv_bias,
        head_dim=number("head_dim", 0) if config.get("head_dim") else 0,
        qk_norm=architecture in WITH_QK_NORM,
        rope_scaling=scaling,
    )


_ROPE_KEYS = {"linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def rope_scaling(scaling: dict, path: str) -> RopeScaling | None:
    """The rotary scaling a config.json states (rope_scaling, or transformers 5's rope_parameters):
    "llama3", "yarn" or "linear" (args.RopeScaling), or none; any other rope type is refused, naming it."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_KINDS:
        raise ConfigError(f"{path}: rope_type {kind!r} is not supported (supported: default, {', '.join(ROPE_KINDS)})")
    missing = [key for key in _ROPE_KEYS[kind] if scaling.get(key) is None]
    if missing:
        raise ConfigError(f"{path}: rope_type {kind!r} needs {', '.join(missing)}")
    numbers = {}  # every number the scaling states, each checked by name
    for key in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
                "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        value = scaling.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{path}: rope_scaling.{key}: {value!r:.40} must be a number")
            numbers[key] = value
    try:
        factor = float(numbers["factor"])
        if kind == "linear":
            return RopeScaling("linear", factor)
        original = int(numbers["original_max_position_embeddings"])
        if kind == "llama3":
            return RopeScaling("llama3", factor, original, float(numbers["low_freq_factor"]),
                               float(numbers["high_freq_factor"]))
        return RopeScaling("yarn", factor, original, beta_fast=float(numbers.get("beta_fast") or 32),
                           beta_slow=float(numbers.get("beta_slow") or 1),
                           attention_factor=yarn_attention_factor(numbers, factor),
                           truncate=bool(scaling.get("truncate", True)))
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None


def yarn_attention_factor(scaling: dict, factor: float) -> float:
    """YaRN's cos/sin multiplier: as stated, else 0.1 ln(factor) + 1 (the paper's), or with
    DeepSeek's mscale and mscale_all_dim the ratio of the two such values they give."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def temperature(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(temperature(float(mscale)) / temperature(float(mscale_all_dim)))
    return temperature(1.0)


def served_positions(max_position: int, scaling: RopeScaling | None) -> int:
    """Positions the model serves, as vLLM reads them: a YaRN scaling extends the original context
    `factor` times (Qwen's instructions state only rope_scaling, keeping max_position_embeddings);
    a linear one (position interpolation) the stated context."""
    if scaling is not None and scaling.kind == "yarn":
        return max(max_position, int(scaling.original_max_position * scaling.factor))
    if scaling is not None and scaling.kind == "linear" and scaling.factor > 1:
        log.info("linear rope scaling x%g: serving %d positions, %d x the factor (as vLLM reads it); where "
                 "max_position_embeddings already states the extended context, bound it with maxSeqLen",
                 scaling.factor, int(max_position * scaling.factor), max_position)
        return int(max_position * scaling.factor)
    return max_position


def check_tensors(args: ModelArgs, tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """Every tensor the model reads is there, in the shape `args` gives it; names the first that is not."""
    kv_dim, q_dim = args.n_kv_heads * args.head_dim, args.q_dim
    expected = {"tok_embeddings.weight": (args.vocab_size, args.dim), "norm.weight": (args.dim,)}
    if not args.tie_embeddings:
        expected["output.weight"] = (args.vocab_size, args.dim)
    if "rope_freqs" in tensors:
        expected["rope_freqs"] = (args.head_dim // 2,)
    for layer in range(args.n_layers):
        shapes = {
            "attention_norm.weight": (args.dim,),
            "attention.wq.weight": (q_dim, args.dim),
            "attention.wk.weight": (kv_dim, args.dim),
            "attention.wv.weight": (kv_dim, args.dim),
            "attention.wo.weight": (args.dim, q_dim),
            "ffn_norm.weight": (args.dim,),
            "feed_forward.w1.weight": (args.ffn_dim, args.dim),
            "feed_forward.w3.weight": (args.ffn_dim, args.dim),
            "feed_forward.w2.weight": (args.dim, args.ffn_dim),
        }
        if args.qkv_bias:
            shapes |= {"attention.wq.bias": (q_dim,), "attention.wk.bias": (kv_dim,), "attention.wv.bias": (kv_dim,)}
        if args.qk_norm:
            shapes |= {"attention.q_norm.weight": (args.head_dim,), "attention.k_norm.weight": (args.head_dim,)}
        expected.update({f"layers.{layer}.{name}": shape for name, shape in shapes.items()})
    for name, shape in expected.items():
        if name not in tensors:
            raise ConfigError(f"{path}: missing tensor {name}")
        if shape_of(tensors, name) != shape:
            raise ConfigError(f"{path}: {name} has shape {shape_of(tensors, name)}, expected {shape}")
