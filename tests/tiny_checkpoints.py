"""Tiny random checkpoints of each architecture family, made by transformers from the family's
config and written the two ways users bring them: a Hugging Face directory (save_pretrained, the
bundled model's tokenizer and chat template) and a GGUF file laid out as llama.cpp's converter
lays it out (its tensor and key names, Llama's interleaved q/k rows, Llama 3.1's rotary scaling as
a "rope_freqs" tensor of per-frequency divisors)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

# One shape per family, small enough to prepare in a second; each exercises what sets the family
# apart: Qwen3 a head_dim apart from hidden / heads (32 * 4 heads = 128 != 64) and q/k norms,
# Llama 3.1 a rotary scaling whose bands all fall inside the positions tested, Qwen2.5 q/k/v biases.
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0)
FAMILIES = {
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
    "llama3.1": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                     tie_word_embeddings=False),
    "qwen2.5": dict(tie_word_embeddings=True),
}
ARCHITECTURE = {"qwen3": "qwen3", "llama3.1": "llama", "qwen2.5": "qwen2"}


def transformers_model(family: str, seed: int = 0):
    """The reference model of a family, random weights (biases and norm weights too, so that a
    mishandled one shows)."""
    import transformers

    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama3.1": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2.5": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    config = config_class(**COMMON, **FAMILIES[family])
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()
            elif "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model


def write_hf(model, directory: Path, tokenizer) -> Path:
    """save_pretrained plus the bundled model's tokenizer.json and chat template."""
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    tokenizer_config = {"chat_template": tokenizer.chat_template, "bos_token": "<|im_start|>",
                        "eos_token": {"content": "<|im_end|>"}}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def llama3_rope_divisors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """What llama.cpp's converter stores as "rope_freqs" for a "llama3" scaling: per frequency,
    1 (short waves), the factor (long waves) or the blend's inverse between."""
    divisors = []
    short_wave = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    long_wave = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < short_wave:
            divisors.append(1.0)
        elif wavelength > long_wave:
            divisors.append(scaling["factor"])
        else:
            blend = (scaling["original_max_position_embeddings"] / wavelength - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"])
            divisors.append(1 / ((1 - blend) / scaling["factor"] + blend))
    return np.array(divisors, dtype=np.float32)


def _interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's Llama converter: each head's rows [first half, second half] become pairs.
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model, family: str, path: Path, tokenizer_gguf: str) -> Path:
    """The model as llama.cpp's converter writes it, in F32, with the tokenizer and chat template
    of the GGUF file `tokenizer_gguf` (the bundled model's)."""
    config = model.config
    architecture = ARCHITECTURE[family]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{family}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(COMMON["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if family == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    _copy_tokenizer(writer, tokenizer_gguf)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                   "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.float().numpy()
        if name in names:
            writer.add_tensor(names[name], values)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if architecture == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
            values = _interleave_rotary(values, heads)
        writer.add_tensor(f"blk.{layer}.{layer_names[module]}.{kind}", values)
    scaling = getattr(config, "rope_scaling", None) or {}
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(scaling, head_dim, COMMON["rope_theta"]))
    elif scaling.get("rope_type") in ("yarn", "linear"):  # metadata keys, as the converter writes them
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        writer.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_tokenizer(writer: gguf.GGUFWriter, source: str) -> None:
    reader = gguf.GGUFReader(source)

    def field(key):
        return reader.fields[key].contents()

    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(field("tokenizer.ggml.tokens"))
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_bos_token_id(int(field("tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(field("tokenizer.ggml.eos_token_id")))
    writer.add_chat_template(field("tokenizer.chat_template"))


def assert_pardec_up_serves_lossless(model: Path, workdir: Path, expected_name: str, text: str) -> None:
    """`pardec up --model MODEL` starts the whole stack as processes; on two prompts parallel
    decoding gives exactly plain decoding's tokens, and every response names the model."""
    import os
    import re
    import signal
    import subprocess
    import sys

    import grpc

    from pardec.runtime.serving import CHANNEL_OPTIONS
    from pardec.v1 import gateway_pb2, gateway_pb2_grpc

    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    process = subprocess.Popen(
        [sys.executable, "-m", "pardec.gateway.cli", "up", "--gateway-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--workdir", str(workdir),
         "--model", str(model)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines, match = [], None
        for line in process.stdout:
            lines.append(line)
            if match := re.search(r"pardec is up: gateway on (\S+)", line):
                break
        assert match, "pardec up did not come up:\n" + "".join(lines)
        with grpc.insecure_channel(match.group(1), options=CHANNEL_OPTIONS) as channel:
            gateway = gateway_pb2_grpc.GatewayStub(channel)
            for prompt in ("Repeat after me: one two three, one two three, one two three.", text[:120]):
                plain, parallel = [
                    gateway.Generate(gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=48, decoding=mode),
                                     timeout=300)
                    for mode in (gateway_pb2.DECODING_MODE_PLAIN, gateway_pb2.DECODING_MODE_DEFAULT)]
                assert list(parallel.token_ids) == list(plain.token_ids) and len(plain.token_ids) > 0
                assert parallel.stats.decoding_method == "memory_decoding"
                assert plain.model == parallel.model == expected_name
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
