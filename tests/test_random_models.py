"""Models of real size with random weights (bench/random_models.py) and the device engine's
measurement at those sizes (bench/device_sizes.py), on a tiny shape under Triton's interpreter."""

import math

import torch

from pardec.bench import device_sizes, random_models
from pardec.verifier.model.args import ModelArgs


def test_the_shapes_have_their_published_parameter_counts():
    counts = {name: sum(math.prod(s) for s in random_models.tensor_shapes(args).values())
              for name, args in random_models.SHAPES.items()}
    # The models' own counts (Qwen3-8B's with its per-head q/k norms).
    assert counts == {"SmolLM2-135M": 134_515_008, "Llama-3-8B": 8_030_261_248, "Qwen2.5-7B": 7_615_616_512,
                      "Qwen3-8B": 8_190_735_360}


def test_random_tensors_are_made_when_read_the_same_each_time_and_not_kept():
    args = ModelArgs("qwen2", 64, 32, 2, 4, 2, 48, 10000.0, 1e-5, 256, False, True)
    tensors = random_models.RandomTensors(args, "cpu")
    assert len(tensors) == len(random_models.tensor_shapes(args)) and "layers.1.attention.wq.bias" in tensors
    assert "layers.0.attention.wq.weight_scale" not in tensors
    first = tensors["layers.0.feed_forward.w1.weight"]
    assert first.shape == (48, 32) and torch.equal(first, tensors["layers.0.feed_forward.w1.weight"])
    assert not torch.equal(first, tensors["layers.1.feed_forward.w1.weight"])
    assert torch.equal(tensors["norm.weight"], torch.ones(32))


def test_device_sizes_measures_a_shape_with_the_device_engine(monkeypatch, on):
    tiny = ModelArgs("llama", 96, 64, 2, 4, 2, 96, 10000.0, 1e-5, 512, True, False)
    monkeypatch.setitem(random_models.SHAPES, "tiny", tiny)
    plan = dict(contexts=[24], trees=[1, 4], batches=[1, 2], rounds=1)
    result = device_sizes.measure_shape("tiny", plan, str(on), bandwidth=1e9)
    assert set(result["step_ms"]["24"]) == {"1x1", "4x1", "1x2", "4x2"}
    bound = result["plain_step_vs_memory_bound"]["24"]
    expected_bytes = result["int8_weight_bytes"] + 24 * 2 * 2 * 2 * 16 * 2  # positions, layers, k+v, kv heads, hd, bf16
    assert result["int8_weight_bytes"] == 2 * (64 * 128 + 64 * 64 + 64 * 192 + 96 * 64) + 96 * 64
    assert math.isclose(bound["bound_ms"], expected_bytes / 1e9 * 1e3, abs_tol=1e-3)
    report = {"date": "d", "gpu": "cpu", "torch": "t", "attention_tuning": "a", "command": "c",
              "copy_bandwidth_gb_s": 1.0, "shapes": {"tiny": result, "broken": {"error": "OOM"}}}
    text = device_sizes.markdown(report)
    assert "## tiny" in text and "| 4 |" in text and "failed: OOM" in text
