"""The families users bring (Qwen3, Llama 3.1+, Qwen2.5), from a Hugging Face directory and from
a GGUF file as llama.cpp writes them: float logits equal transformers', and the W8A8 model serves
through the real stack with parallel decoding token-identical to plain decoding."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pardec.runtime.architectures import ARCHITECTURES
from pardec.runtime.errors import ConfigError
from pardec.verifier.loading import load_model
from pardec.verifier.model.args import ModelArgs
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.rotary import inverse_frequencies
from pardec.verifier.model.weights import default_model_path, load_checkpoint
from tests.tiny_checkpoints import assert_pardec_up_serves_lossless, ARCHITECTURE, FAMILIES, transformers_model, write_gguf, write_hf

PARDEC = [sys.executable, "-m", "pardec.gateway.cli"]
# Past the Llama 3.1 fixture's original context (64), so every rotary band is exercised.
TEXT = "A small random model still has to agree with its reference, position after position. " * 8


@pytest.fixture(scope="module")
def bundled():
    return load_checkpoint(None)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, bundled, tmp_path_factory):
    """(family, reference model, HF directory, GGUF path)."""
    model = transformers_model(request.param)
    directory = write_hf(model, tmp_path_factory.mktemp(request.param), bundled.tokenizer)
    gguf_path = write_gguf(model, request.param, directory / "model.gguf", default_model_path())
    return request.param, model, directory, gguf_path


def _logits(model, args, tokens):
    cache = KVCache(args, len(tokens))
    count = len(tokens)
    return model(torch.tensor(tokens), torch.arange(count), torch.ones(count, count, dtype=torch.bool).tril(), cache)


@pytest.mark.parametrize("layout", ["hf", "gguf"])
def test_float_logits_match_transformers(family, bundled, layout):
    name, reference, directory, gguf_path = family
    checkpoint = load_checkpoint(str(directory if layout == "hf" else gguf_path))
    args = checkpoint.args
    assert args.architecture == ARCHITECTURE[name] and args.qk_norm == (name == "qwen3")
    assert args.head_dim == (32 if name == "qwen3" else 16) and args.q_dim == (128 if name == "qwen3" else 64)
    if name == "llama3.1":  # the scaling as stated (HF) or as llama.cpp's divisors (GGUF)
        assert (args.rope_scaling is not None) == (layout == "hf") and ("rope_freqs" in checkpoint.tensors) == (layout == "gguf")
    tokens = bundled.tokenizer.encode(TEXT)[:160]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    for quantization, tolerance in (("none", 1e-4), ("w8a8", 0.15)):
        model = load_model(checkpoint, quantization)
        torch.testing.assert_close(_logits(model, args, tokens), expected, rtol=0, atol=tolerance)


def test_what_sets_a_family_apart_changes_its_logits(family, bundled):
    """The fixtures are not blind to the features: without Llama 3.1's scaling or Qwen3's q/k norms
    the same weights give other logits."""
    name, _, directory, _ = family
    checkpoint = load_checkpoint(str(directory))
    args = checkpoint.args
    tokens = bundled.tokenizer.encode(TEXT)[:160]
    ours = _logits(load_model(checkpoint, "none"), args, tokens)
    tensors = dict(checkpoint.tensors)  # read once, to change some (the loader's are read on demand)
    if name == "llama3.1":
        plain = ModelArgs(**{**vars(args), "rope_scaling": None})
        assert not torch.equal(inverse_frequencies(plain), inverse_frequencies(args))
    elif name == "qwen3":
        plain = args
        for layer in range(args.n_layers):
            for norm in ("q_norm", "k_norm"):
                tensors[f"layers.{layer}.attention.{norm}.weight"] = torch.ones(args.head_dim)
    else:
        return
    other = load_model(type(checkpoint)(plain, tensors, checkpoint.model_name, checkpoint.tokenizer), "none")
    assert (_logits(other, plain, tokens) - ours).abs().max() > 1e-2


def test_pardec_up_model_serves_it_lossless(family, tmp_path):
    """`pardec up --model` (a checkpoint directory, or llama.cpp's GGUF for Llama 3.1) starts the
    whole stack as processes on the W8A8 model: parallel decoding gives exactly plain decoding's
    tokens, and every response names the model."""
    name, _, directory, gguf_path = family
    model = gguf_path if name == "llama3.1" else directory
    assert_pardec_up_serves_lossless(model, tmp_path, "tiny-llama3.1" if name == "llama3.1" else directory.name, TEXT)


def test_one_list_of_architectures():
    from pardec.gateway import rules
    from pardec.verifier.model import args

    assert rules.ARCHITECTURES is ARCHITECTURES and args.SUPPORTED_ARCHITECTURES is ARCHITECTURES
    assert set(ARCHITECTURE.values()) == set(ARCHITECTURES)


@pytest.mark.parametrize("change, named", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_what_cannot_be_served_is_named(family, tmp_path, change, named):
    if not _llama_copied(family, tmp_path):
        return
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        load_checkpoint(str(tmp_path))


def _llama_copied(family, into: Path) -> bool:
    """The Llama 3.1 fixture's files copied into ``into`` (False, nothing done, for another family)."""
    name, _, directory, _ = family
    if name != "llama3.1":
        return False
    for item in directory.iterdir():
        if item.suffix in (".json", ".safetensors"):
            (into / item.name).write_bytes(item.read_bytes())
    return True


def _config_edit(**changes):
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (directory / "config.json").write_text(json.dumps(config))
    return edit


@pytest.mark.parametrize("edit, named", [
    (_config_edit(intermediate_size=None), "config.json has no intermediate_size"),
    (_config_edit(num_attention_heads="4"), "num_attention_heads must be an integer, got '4'"),
    (_config_edit(rope_scaling="linear"), "rope_scaling must be an object"),
    (lambda d: (d / "config.json").write_text("[]"), "config.json: must be a JSON object, not list"),
    (lambda d: (d / "tokenizer_config.json").write_text("{"), "tokenizer_config.json: not a readable JSON file"),
    (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": "x"}'), "eos_token_id must be a token id"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-5000]),
     "model.safetensors: not a readable safetensors file"),
])
def test_a_malformed_checkpoint_is_a_configuration_error_naming_its_file(family, tmp_path, edit, named):
    """Not a KeyError, TypeError or safetensors' own error naming nothing: the verifier's command
    line says it in one line and exits 2."""
    if not _llama_copied(family, tmp_path):
        return
    edit(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_checkpoint(str(tmp_path))
    if "intermediate_size" in named:
        said = subprocess.run([sys.executable, "-m", "pardec.verifier", "--model", str(tmp_path), "--addr",
                               "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
        assert said.returncode == 2 and "configuration error" in said.stderr and "Traceback" not in said.stderr
