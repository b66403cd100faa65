"""A checkpoint of a published 1-2B shape with random weights, written where it runs (nothing is
downloaded): what `python -m pardec.bench.verifier_start --model DIR` loads to measure a float
checkpoint's first start (streamed W8A8 preparation) and later starts at a size where host
memory matters.

    python -m pardec.bench.big_checkpoint DIR [--shape llama-3.2-1b | qwen3-0.6b] [--w8a8]

The shape is the published config.json's (Llama-3.2-1B: 16 layers, width 2048, 32 / 8 heads,
FFN 8192, vocabulary 128256, tied embeddings, llama3 rotary scaling; Qwen3-0.6B: 28 layers, width
1024, 16 / 8 heads of 128, so q is twice the width, q/k norms, FFN 3072, vocabulary 151936, tied);
the weights are bf16, as the published checkpoints', made by transformers from that config; the
tokenizer is the bundled model's (its 49152 ids are a part of the larger vocabulary). With --w8a8
the linear layers are written as llm-compressor writes its W8A8 int8 scheme (compressed-tensors:
int8 weights with a bf16 scale per output channel; embeddings and norms left bf16), a checkpoint
the verifier uses as stored.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SHAPES = {  # the transformers family, then the published config's values
    "llama-3.2-1b": ("Llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "qwen3-0.6b": ("Qwen3", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
}


# config.json's quantization_config for --w8a8: llm-compressor's W8A8 int8 scheme, per-channel
# symmetric weights and dynamic per-token activations (what the verifier runs as stored).
COMPRESSED_TENSORS_W8A8 = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                              "group_size": None, "observer": None},
    }},
}


def compressed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder layers' linear weights as int8 with a scale per output channel (round to nearest)."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            scale = (tensor.float().abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12).bfloat16()
            out[name] = torch.round(tensor.float() / scale.float()).clamp(-128, 127).to(torch.int8)
            out[name.removesuffix("weight") + "weight_scale"] = scale
        else:
            out[name] = tensor
    return out


def write(directory: Path, shape: str, seed: int = 0, w8a8: bool = False) -> Path:
    import transformers

    from pardec.verifier.model.weights import load_checkpoint

    torch.manual_seed(seed)
    family, values = SHAPES[shape]
    config = getattr(transformers, f"{family}Config")(**values)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    finally:
        torch.set_default_dtype(previous)
    directory.mkdir(parents=True, exist_ok=True)
    if w8a8:
        model.save_pretrained(directory, state_dict=compressed(model.state_dict()), max_shard_size="1GB")
        config_path = directory / "config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()),
                                           "quantization_config": COMPRESSED_TENSORS_W8A8}, indent=2))
    else:
        model.save_pretrained(directory, max_shard_size="1GB")
    tokenizer = load_checkpoint(None).tokenizer
    (directory / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tokenizer.chat_template, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}))
    return directory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.bench.big_checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--w8a8", action="store_true", help="linear layers int8 in compressed-tensors' layout")
    args = parser.parse_args(argv)
    print(write(args.directory, args.shape, w8a8=args.w8a8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
