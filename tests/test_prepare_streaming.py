"""The W8A8 preparation streams a checkpoint one layer at a time (prepare/precondition.py) and
gives the bits the whole-model preparation gives; checkpoints are read lazily (model/lazy_tensors.py,
model/gguf_file.py)."""

import doctest
import gc
import weakref

import gguf
import numpy as np
import pytest
import torch

import pardec.verifier.model.gguf_file
import pardec.verifier.model.lazy_tensors
from pardec.verifier.model.gguf_file import GGUFFile
from pardec.verifier.model.lazy_tensors import LazyTensors
from pardec.verifier.model.transformer import Transformer
from pardec.verifier.model.weights import default_model_path, load_checkpoint
from pardec.verifier.prepare.gptq import quantize_tensors
from pardec.verifier.prepare.precondition import Statistics, precondition
from pardec.verifier.prepare.rotation import rotate
from pardec.verifier.prepare.smoothing import calibration_token_lists, run_calibration, smooth, smoothing_factors
from pardec.verifier.prepare.workers import Workers
from tests.test_quant import tiny_args, tiny_tensors

torch.set_num_threads(1)


def test_docstring_examples():
    assert doctest.testmod(pardec.verifier.model.gguf_file).failed == 0
    assert doctest.testmod(pardec.verifier.model.lazy_tensors).failed == 0


@pytest.fixture(scope="module")
def tokenizer():
    return load_checkpoint(None).tokenizer


def whole_model_preparation(args, tensors, tokenizer, gptq=True):
    """The preparation as one float model: rotate everything, one forward of the whole rotated
    model over the calibration text, smooth everything, GPTQ everything."""
    rotated = rotate(args, tensors)
    statistics = Statistics(gptq)
    run_calibration(Transformer(args, rotated, "none", attention="fp64"), calibration_token_lists(tokenizer),
                    statistics.record)
    factors = smoothing_factors(args, rotated, statistics.maxima)
    smoothed = smooth(args, rotated, factors)
    if not gptq:
        return smoothed
    hessians = {name: h / torch.outer(factors[name], factors[name]) if name in factors else h
                for name, h in statistics.hessians.items()}
    return quantize_tensors(args, smoothed, hessians)


@pytest.mark.parametrize("architecture, ffn_dim, gptq, workers", [
    ("llama", 128, True, 1), ("qwen2", 80, True, 1), ("llama", 80, False, 1), ("llama", 128, True, 3),
    ("qwen2", 80, False, 2)])
def test_layer_by_layer_preparation_gives_the_whole_models_bits(tokenizer, architecture, ffn_dim, gptq, workers):
    """Streamed a layer at a time, its independent pieces spread over any number of workers
    (workers.py): the bits of the whole model prepared at once, one piece after another."""
    args = tiny_args(architecture, ffn_dim)
    tensors = tiny_tensors(args)
    with Workers(workers) as pool:
        streamed = precondition(args, tensors, tokenizer, gptq, pool)
    whole = whole_model_preparation(args, tensors, tokenizer, gptq)
    assert set(streamed) == set(whole)
    different = [name for name in whole if not torch.equal(streamed[name], whole[name])]
    assert different == []


def test_preparation_reads_each_layer_once_and_lets_it_go(tokenizer):
    """The float tensors of layer i are gone before layer i + 1 is read: host memory holds one
    layer in float, not the model."""
    args = tiny_args("llama", 128)
    source = tiny_tensors(args)
    reads, alive = [], {}

    def load(name):
        reads.append(name)
        tensor = source[name].clone()
        if name.startswith("layers.") and tensor.dim() == 2:
            layer = int(name.split(".")[1])
            alive[name] = weakref.ref(tensor)
            gc.collect()
            earlier = [n for n, ref in alive.items() if int(n.split(".")[1]) < layer and ref() is not None]
            assert earlier == [], f"reading {name} while {earlier} are still held"
        return tensor

    lazy = LazyTensors({name: tuple(t.shape) for name, t in source.items()}, load)
    prepared = precondition(args, lazy, tokenizer)
    # Each layer's tensors once; the embedding table and the final norm again for the (tied) head,
    # which is made at the end rather than held in float while the layers stream.
    assert sorted(reads) == sorted([*source, "tok_embeddings.weight", "norm.weight"])
    assert all(prepared[f"layers.{i}.attention.wq.weight"].dtype == torch.int8 for i in range(args.n_layers))


def test_gguf_header_reader_agrees_with_the_gguf_package():
    path = default_model_path()
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert set(ours.fields) == {key for key in theirs.fields if not key.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == field.contents(), key
    assert list(ours.tensors) == [tensor.name for tensor in theirs.tensors]
    for tensor in theirs.tensors[:12]:
        entry = ours.tensors[tensor.name]
        assert entry.shape == tuple(int(d) for d in reversed(tensor.shape)) and entry.ggml_type == tensor.tensor_type
        assert np.array_equal(ours.array(tensor.name), tensor.data)


def test_a_start_from_the_prepared_cache_reads_no_checkpoint_tensor(tmp_path, monkeypatch):
    from pardec.verifier.loading import load_model
    from pardec.verifier.prepare.cache import PreparedCache

    checkpoint = load_checkpoint(None)
    cache = PreparedCache(tmp_path)
    first = load_model(checkpoint, prepared_cache=cache, kernel="fp32_exact")
    reads = {"checkpoint": [], "cache": []}
    second = load_checkpoint(None)
    original = LazyTensors.__getitem__
    monkeypatch.setattr(LazyTensors, "__getitem__", lambda self, name: reads[
        "checkpoint" if self is second.tensors else "cache"].append(name) or original(self, name))
    again = load_model(second, prepared_cache=cache, kernel="fp32_exact")
    assert reads["checkpoint"] == [] and len(reads["cache"]) == len(set(reads["cache"])) > 0  # each once
    assert torch.equal(first.layers[3].attention.wqkv.integer_weight(), again.layers[3].attention.wqkv.integer_weight())
