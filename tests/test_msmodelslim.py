"""msModelSlim W8A8 checkpoints (static and dynamic activations, int64 and float32 deq_scale, one
file and shards with an index, FLOAT exceptions, anti-outlier norm biases): they load as stored,
the static layers compute exactly a plain numpy evaluation of the format's integer arithmetic,
other schemes are refused in one line, and `pardec up --model` serves one lossless."""

from __future__ import annotations

import glob
import json
import re
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pardec.verifier.loading import load_model
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.static_quant import StaticW8A8Linear, decode_deq_scale
from pardec.verifier.model.weights import load_checkpoint
from tests.msmodelslim_fixture import fp32_bits_as_int64, write_msmodelslim
from tests.tiny_checkpoints import assert_pardec_up_serves_lossless, transformers_model

PARDEC = [sys.executable, "-m", "pardec.gateway.cli"]
TEXT = "A small random model still has to agree with its reference, position after position. " * 3
# name -> (family, writer options): every variant the issue lists, spread over three families.
VARIANTS = {
    "static-fp16-sharded": ("llama3.1", dict(scheme="W8A8", dtype=torch.float16, sharded=True, legacy_norm=True,
                                             float_layers=("lm_head", "model.layers.1.mlp.down_proj"))),
    # layer 0's q_proj a FLOAT exception: it keeps its q bias, the static k/v layers fold theirs
    "static-bf16": ("qwen2.5", dict(scheme="W8A8", dtype=torch.bfloat16,
                                    float_layers=("lm_head", "model.layers.0.self_attn.q_proj"))),
    "dynamic": ("qwen3", dict(scheme="W8A8_DYNAMIC", dtype=torch.bfloat16)),
}
PARTS = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "wo": ("self_attn.o_proj",),
         "w13": ("mlp.gate_proj", "mlp.up_proj"), "w2": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def bundled():
    return load_checkpoint(None)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, bundled, tmp_path_factory):
    family, options = VARIANTS[request.param]
    model = transformers_model(family)
    tokens = bundled.tokenizer.encode(TEXT)
    directory = write_msmodelslim(model, tmp_path_factory.mktemp(request.param), bundled.tokenizer, tokens[:40],
                                  **options)
    return request.param, model, directory, tokens[:64]


def _logits(model, args, tokens):
    cache, count = KVCache(args, len(tokens)), len(tokens)
    return model(torch.tensor(tokens), torch.arange(count), torch.ones(count, count, dtype=torch.bool).tril(), cache)


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in glob.glob(str(directory / "quant_model_weight*.safetensors")):
        tensors |= load_file(file)
    return tensors


def _fp32_from_bits(value: int) -> np.float32:
    return np.float32(struct.unpack("<f", struct.pack("<I", value & 0xFFFFFFFF))[0])


class NumpyStatic(torch.nn.Module):
    """The format's arithmetic written out plainly over the stored tensors, one layer after another:
    q = clip(rint(x * fp32(1 / s)) + o, -128, 127); acc = q @ W^T + quant_bias in int64;
    y = fp32(acc) * deq_scale."""

    def __init__(self, stored: dict[str, torch.Tensor], prefixes: list[str]):
        super().__init__()
        self.parts = []
        for prefix in prefixes:
            deq = stored[f"{prefix}.deq_scale"]
            deq = (np.array([_fp32_from_bits(int(v)) for v in deq.tolist()], dtype=np.float32)
                   if deq.dtype == torch.int64 else deq.float().numpy())
            self.parts.append((stored[f"{prefix}.weight"].numpy().astype(np.int64),
                               stored[f"{prefix}.quant_bias"].numpy().astype(np.int64), deq,
                               np.float32(1) / np.float32(stored[f"{prefix}.input_scale"].float().item()),
                               float(stored[f"{prefix}.input_offset"].float().item())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.numpy()
        outs = []
        for weight, quant_bias, deq, reciprocal, offset in self.parts:
            q = np.clip(np.rint(x * reciprocal.astype(x.dtype)) + offset, -128, 127).astype(np.int64)
            outs.append((q @ weight.T + quant_bias).astype(np.float32) * deq)
        return torch.from_numpy(np.concatenate(outs, axis=-1))


def test_static_layer_on_literal_values():
    """Two rows through a 3 -> 2 layer, worked by hand: x * (1 / 0.5) rounds half to even, the
    offset 3 is added, the top clips at 127."""
    weight = torch.tensor([[1, -2, 3], [-128, 127, 0]], dtype=torch.int8)
    x = torch.tensor([[0.25, -1.0, 1.25], [100.0, 0.75, -0.5]])
    # q rows: [round(0.5)+3, round(-2)+3, round(2.5)+3] = [3, 1, 5]; [clip(203), round(1.5)+3, round(-1)+3] = [127, 5, 2]
    expected_sums = torch.tensor([[3 - 2 + 15 + 10, -384 + 127 - 7], [127 - 10 + 6 + 10, -16256 + 635 - 7]])
    deq = torch.tensor([0.5, 0.25])
    for kernel in ("fp32_exact", "int_mm", "native"):
        layer = StaticW8A8Linear(weight, torch.tensor([10, -7]), deq, 0.5, 3.0, kernel)
        assert torch.equal(layer.quantize_input(x), torch.tensor([[3.0, 1.0, 5.0], [127.0, 5.0, 2.0]]))
        assert torch.equal(layer(x), expected_sums.float() * deq)
        assert torch.equal(layer(x[1:]), layer(x)[1:])  # a row alone, bit for bit


def test_deq_scale_int64_is_the_fp32_bit_pattern():
    values = torch.tensor([0.5, 1.5e-6, 3.0e-4])
    packed = fp32_bits_as_int64(values)
    assert packed.dtype == torch.int64 and packed[0].item() == 0x3F000000
    assert torch.equal(decode_deq_scale(packed, "x"), values)
    assert torch.equal(decode_deq_scale(values, "x"), values)
    with pytest.raises(ValueError, match="bits above"):
        decode_deq_scale(torch.tensor([1 << 40]), "x")


def test_fixture_follows_the_format(variant):
    """Field by field what msModelSlim's saver writes (docs/models.md): names, dtypes, shapes,
    description types, the index naming every tensor once."""
    name, model, directory, _ = variant
    scheme = VARIANTS[name][1]["scheme"]
    description = json.loads((directory / f"quant_model_description_{scheme.lower()}.json").read_text())
    stored = _stored(directory)
    assert description["model_quant_type"] == scheme and set(stored) == set(description) - {"model_quant_type"}
    index = directory / f"quant_model_weight_{scheme.lower()}.safetensors.index.json"
    assert index.exists() == (name == "static-fp16-sharded")
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        assert set(weight_map) == set(stored) and len(set(weight_map.values())) == 2
    config = model.config
    for layer in range(config.num_hidden_layers):
        for part in (p for parts in PARTS.values() for p in parts):
            prefix = f"model.layers.{layer}.{part}"
            if description[f"{prefix}.weight"] == "FLOAT":
                assert stored[f"{prefix}.weight"].is_floating_point()
                continue
            out = stored[f"{prefix}.weight"].shape[0]
            fields = {"weight": (torch.int8, None), "weight_scale": (None, (out, 1)), "weight_offset": (None, (out, 1))}
            if scheme == "W8A8":
                fields |= {"quant_bias": (torch.int32, (out,)), "input_scale": (None, (1,)), "input_offset": (None, (1,)),
                           "deq_scale": (torch.int64 if VARIANTS[name][1]["dtype"] == torch.float16 else torch.float32,
                                         (out,))}
            for field, (dtype, shape) in fields.items():
                assert description[f"{prefix}.{field}"] == scheme
                assert dtype is None or stored[f"{prefix}.{field}"].dtype == dtype
                assert shape is None or tuple(stored[f"{prefix}.{field}"].shape) == shape
            assert not stored[f"{prefix}.weight_offset"].any()
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert description[f"model.layers.{layer}.{norm}.bias"] == "FLOAT"


def test_logits_equal_the_reference_arithmetic(variant):
    """The loaded W8A8 model's logits are bit for bit those of the same model whose static layers
    are NumpyStatic over the files' tensors; every kernel gives those bits; the float model (the
    dequantized function) is near transformers' and near the W8A8 model."""
    name, reference, directory, tokens = variant
    checkpoint = load_checkpoint(str(directory))
    assert checkpoint.prequantized
    args = checkpoint.args
    outputs = {kernel: _logits(load_model(checkpoint, "w8a8", kernel=kernel), args, tokens)
               for kernel in ("fp32_exact", "int_mm", "native")}
    assert all(torch.equal(outputs["fp32_exact"], logits) for logits in outputs.values())
    if VARIANTS[name][1]["scheme"] == "W8A8":
        stored = _stored(directory)
        model = load_model(checkpoint, "w8a8", kernel="int_mm")
        replaced = 0
        for layer, block in enumerate(model.layers):
            for attribute, parts in PARTS.items():
                prefixes = [f"model.layers.{layer}.{part}" for part in parts]
                if all(f"{prefix}.deq_scale" in stored for prefix in prefixes):
                    owner = block.attention if attribute in ("wqkv", "wo") else block.feed_forward
                    setattr(owner, attribute, NumpyStatic(stored, prefixes))
                    replaced += 1
        assert replaced == 4 * args.n_layers - (name in ("static-fp16-sharded", "static-bf16"))
        assert torch.equal(_logits(model, args, tokens), outputs["fp32_exact"])
    float_logits = _logits(load_model(checkpoint, "none"), args, tokens)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    assert (float_logits - expected).abs().max() < 0.1
    assert (float_logits - outputs["fp32_exact"]).abs().max() < 0.15


@pytest.mark.parametrize("change, named", [
    ({"model_quant_type": "W8A16"}, "model_quant_type 'W8A16'"),
    ({"model_quant_type": "W4A8_DYNAMIC"}, "model_quant_type 'W4A8_DYNAMIC'"),
    ({"kv_cache_type": "C8"}, "kv_cache_type 'C8'"),
    ({"model.layers.0.mlp.up_proj.weight": "W8A8S"}, "'W8A8S' for model.layers.0.mlp.up_proj.weight"),
])
@pytest.mark.parametrize("variant", ["static-bf16"], indirect=True)
def test_other_schemes_are_refused_in_one_line(variant, tmp_path, change, named):
    _, _, directory, _ = variant
    for item in directory.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    path = tmp_path / "quant_model_description_w8a8.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ValueError, match=re.escape(named)) as error:
        load_checkpoint(str(tmp_path))
    assert "\n" not in str(error.value) and "not supported" in str(error.value)


def test_the_msmodelslim_package_output_loads(bundled, tmp_path):
    """When msModelSlim itself is installed (it runs on CPU), its own W8A8 output of a tiny model
    names the same tensors with the same integer dtypes as our writer's, loads, and is as near
    transformers as ours."""
    tools = pytest.importorskip("msmodelslim.pytorch.llm_ptq.llm_ptq_tools")
    model = transformers_model("llama3.1")
    tokens = bundled.tokenizer.encode(TEXT)
    with torch.no_grad():
        expected = model(torch.tensor([tokens[:64]])).logits[0]
    ours = _stored(write_msmodelslim(model, tmp_path / "ours", bundled.tokenizer, tokens[:40], norm_bias=0.0))
    directory = write_msmodelslim(model, tmp_path / "theirs", bundled.tokenizer, tokens[:40], norm_bias=0.0)
    for file in directory.glob("quant_model_*"):
        file.unlink()
    config = tools.QuantConfig(w_bit=8, a_bit=8, disable_names=["lm_head"], dev_type="cpu", act_method=1, pr=1.0,
                               mm_tensor=False)
    calibrator = tools.Calibrator(model, config, calib_data=[[torch.tensor([tokens[:40]])]], disable_level="L0")
    calibrator.run()
    calibrator.save(str(directory), save_type=["safe_tensor"])
    theirs = _stored(directory)
    assert set(theirs) == set(ours)
    assert all(theirs[k].dtype == ours[k].dtype for k in theirs if not ours[k].is_floating_point())
    checkpoint = load_checkpoint(str(directory))
    logits = _logits(load_model(checkpoint, "w8a8", kernel="fp32_exact"), checkpoint.args, tokens[:64])
    assert (logits - expected).abs().max() < 0.15


@pytest.mark.parametrize("variant", ["static-fp16-sharded", "dynamic"], indirect=True)
def test_pardec_up_model_serves_it_lossless(variant, tmp_path):
    """`pardec up --model DIR` on the static fp16 sharded checkpoint (norm biases, a FLOAT down_proj)
    and on the dynamic one (Qwen3): parallel decoding gives exactly plain decoding's tokens."""
    _, _, directory, _ = variant
    assert_pardec_up_serves_lossless(directory, tmp_path, directory.name, TEXT)
