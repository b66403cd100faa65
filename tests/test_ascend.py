"""The Ascend NPU path (verifier/model/ascend.py, fixed_order.py) on this CPU, with torch-npu's ops
replaced by their CPU references (tests/ascend_reference.py).

The CPU path it mirrors: transformer.py's modules with `attention="fixed_order"` and the exact
`torch._int_mm` kernel ("int_mm") -- the same fixed-order fp32 attention, norm and SwiGLU, with
quant.quantize_activation for the rows and int32 sums scaled after the product. The NPU path must
compute that path's bits: the only difference is which ops quantize and multiply, and the
references compute what torch-npu documents. Whether the card computes the same is for the
startup probes on real hardware (ascend.startup_ops); here: that the NPU code path wires them
right, is batch invariant, never makes an fp64 tensor, and refuses a host it cannot serve with one
clear error.
"""

import doctest
import random
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ascend_reference import NpuQueries, npu_quant_matmul, reference_torch_npu
from tests.steps import assert_nodes_are_plain_decoding, causal, chain_step, prefill
from tests.test_quant import tiny_tensors
from pardec.runtime.errors import ConfigError
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.devices import resolve_device
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model import ascend, fixed_order
from pardec.verifier.model.args import ModelArgs
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.static_quant import StaticW8A8Linear
from pardec.verifier.model.step import StepInput
from pardec.verifier.model.transformer import Transformer

ARGS = ModelArgs(architecture="qwen2", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                 rope_theta=1e4, norm_eps=1e-6, max_position=256, tie_embeddings=True, qkv_bias=True)


@pytest.fixture(scope="module")
def tensors():
    tensors = tiny_tensors(ARGS)
    for layer in range(ARGS.n_layers):  # down_proj's online rotation, as the preconditioned models have
        tensors[f"layers.{layer}.feed_forward.w2.input_hadamard"] = torch.tensor(64)
    return tensors


@pytest.fixture(scope="module", params=[True, False], ids=["npu_dynamic_quant", "torch row quantization"])
def npu_model(request, tensors):
    """The NPU path on CPU tensors: its rows quantized by npu_dynamic_quant, or by the torch ops
    startup_ops falls back to."""
    ops = ascend.AscendOps(reference_torch_npu(), quantizes_rows_on_npu=request.param)
    return Transformer(ARGS, tensors, "w8a8", kernel="npu_quant_matmul", attention="fixed_order", ascend=ops)


@pytest.fixture(scope="module")
def cpu_mirror(tensors):
    return Transformer(ARGS, tensors, "w8a8", kernel="int_mm", attention="fixed_order")


def small_tree(n_nodes: int, seed: int):
    rng = random.Random(seed)
    parents = [-1] + [0 if node <= 2 else rng.randrange(0, node) for node in range(1, n_nodes + 1)]
    ancestors = torch.eye(n_nodes + 1, dtype=torch.bool)
    depths = torch.zeros(n_nodes + 1, dtype=torch.long)
    for node in range(1, n_nodes + 1):
        ancestors[node] |= ancestors[parents[node]]
        depths[node] = depths[parents[node]] + 1
    return torch.tensor([rng.randrange(ARGS.vocab_size) for _ in parents]), parents, depths, ancestors


def mixed_forward(model) -> list[torch.Tensor]:
    """Prefills of three sessions, then one forward of a tree step, a one-token step and a prompt
    chunk of the three: every forward's logits, in order."""
    pool = model.new_pool(1024, 8)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, ARGS.vocab_size, (n,), generator=generator).tolist() for n in (13, 70, 9)]
    outputs = []
    sessions = []
    for prompt in prompts:
        cache = pool.session()
        cache.reserve(len(prompt))
        outputs.append(model.forward_batch([chain_step(prompt, cache)])[0])
        cache.commit(torch.arange(len(prompt)), trim=False)
        sessions.append(cache)
    tokens, _, depths, ancestors = small_tree(9, seed=4)
    for cache, rows in zip(sessions, (len(tokens), 1, 6)):
        cache.reserve(rows)
    outputs += model.forward_batch([StepInput(tokens, depths, ancestors, sessions[0]), chain_step([5], sessions[1]),
                                    chain_step([7, 8, 9, 10, 11, 12], sessions[2])])
    return outputs


# ---- startup: one clear error for a host the NPU path cannot serve -------------------------------

@pytest.fixture
def host(monkeypatch):
    """Installs a stand-in torch_npu and torch.npu for one test: host(module, queries)."""
    def install(module, queries=None):
        monkeypatch.setitem(sys.modules, "torch_npu", module)
        monkeypatch.setattr(torch, "npu", queries or NpuQueries(), raising=False)
    return install


def test_a_missing_torch_npu_is_one_clear_startup_error(host):
    host(None)  # a None entry in sys.modules makes the import fail, as on a host without torch-npu
    for check in (lambda: resolve_device("npu:0"), lambda: ascend.startup_ops("npu:0")):
        with pytest.raises(ConfigError, match=r"'npu:0': torch-npu is not installed.*CANN"):
            check()


@pytest.mark.parametrize("op", sorted(ascend.REQUIRED_OPS))
def test_a_torch_npu_without_an_op_is_one_clear_startup_error(host, op):
    host(reference_torch_npu(without=op))
    with pytest.raises(ConfigError, match=rf"'npu:1': torch-npu reference has no torch_npu\.{op} .*Atlas A2/A3"):
        resolve_device("npu:1")


@pytest.mark.parametrize("card", ["Ascend310P3", "Ascend910A", "Ascend910ProB"])
def test_an_unsupported_card_is_one_clear_startup_error(host, card):
    host(reference_torch_npu(), NpuQueries(card))
    with pytest.raises(ConfigError, match=rf"'npu:0' is an '{card}'.*Atlas A2 .*Ascend910B\*.*Ascend910_93\*"):
        resolve_device("npu:0")


def test_no_npu_or_too_few_are_clear_startup_errors(host):
    host(reference_torch_npu(), NpuQueries(available=False))
    with pytest.raises(ConfigError, match="found no Ascend NPU"):
        resolve_device("npu")
    host(reference_torch_npu(), NpuQueries(count=2))
    with pytest.raises(ConfigError, match="only 2 npu device"):
        resolve_device("npu:2")


@pytest.mark.parametrize("card", ["Ascend910B1", "Ascend910B4", "Ascend910_9391", "Ascend910_9372"])
def test_atlas_a2_and_a3_cards_pass_the_checks(host, card):
    host(reference_torch_npu(), NpuQueries(card))
    ascend.check_device(f"npu:{1}", 1)  # resolve_device would go on to torch.device("npu"), which needs torch-npu


def test_startup_probes_accept_the_documented_ops_and_refuse_an_inexact_product(host):
    host(reference_torch_npu())
    assert ascend.startup_ops("cpu").quantizes_rows_on_npu

    def refuses_fp32(input, *, smooth_scales=None):
        raise RuntimeError("input dtype float32 is not supported")

    host(reference_torch_npu(npu_dynamic_quant=refuses_fp32))
    assert not ascend.startup_ops("cpu").quantizes_rows_on_npu  # the torch quantization instead

    def through_fp16(x1, x2, scale, **kwargs):  # sums through an fp16 output, as inference cards give
        return (x1.float() @ x2.float()).half().float().nan_to_num().to(torch.int32)

    host(reference_torch_npu(npu_quant_matmul=through_fp16))
    with pytest.raises(ConfigError, match="npu_quant_matmul with int32 output .* not exact"):
        ascend.startup_ops("cpu")


def test_doctests_and_the_cards_named():
    assert doctest.testmod(ascend).failed == 0 and doctest.testmod(fixed_order).failed == 0
    assert [card.prefix for card in ascend.SUPPORTED_CARDS] == ["Ascend910B", "Ascend910_93"]


# ---- the NPU path computes its CPU mirror's bits, batch invariant, without fp64 -------------------

def test_the_npu_path_computes_the_cpu_fixed_order_paths_bits(npu_model, cpu_mirror):
    npu, cpu = mixed_forward(npu_model), mixed_forward(cpu_mirror)
    assert len(npu) == 6
    for got, expected in zip(npu, cpu):
        assert torch.equal(got, expected)


def test_a_static_w8a8_layer_on_the_ascend_ops_computes_the_int_mm_layers_bits():
    generator = torch.Generator().manual_seed(5)
    weight = torch.randint(-128, 128, (48, 96), generator=generator, dtype=torch.int8)
    quant_bias, deq_scale = torch.randint(-5000, 5000, (48,), generator=generator), torch.rand(48, generator=generator) * 1e-3
    x = torch.randn(7, 96, generator=generator) * 3
    on_npu = StaticW8A8Linear(weight, quant_bias, deq_scale, 0.05, 3, "npu_quant_matmul", ascend.AscendOps(reference_torch_npu()))
    assert torch.equal(on_npu(x), StaticW8A8Linear(weight, quant_bias, deq_scale, 0.05, 3, "int_mm")(x))


def test_tree_rows_get_plain_decodings_logits_alone_beside_sessions_and_after_chunked_prefill(npu_model):
    model = npu_model
    pool = model.new_pool(1024, 8)
    prompt = torch.randint(0, ARGS.vocab_size, (13,), generator=torch.Generator().manual_seed(9)).tolist()
    tokens, parents, depths, ancestors = small_tree(6, seed=2)
    whole = prefill(model, pool, prompt)
    whole.reserve(len(parents))
    alone = model.forward_batch([StepInput(tokens, depths, ancestors, whole)])[0]

    chunked = prefill(model, pool, prompt, chunks=[5, 1, 7])
    other = prefill(model, pool, prompt[:9])
    chunked.reserve(len(parents))
    other.reserve(3)
    batched = model.forward_batch([chain_step([4, 5, 6], other), StepInput(tokens, depths, ancestors, chunked)])[1]
    assert torch.equal(alone, batched)

    assert_nodes_are_plain_decoding(model, pool, prompt, tokens, parents, alone)


class DtypesMade(TorchDispatchMode):
    """Records the dtype of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.dtypes: dict[torch.dtype, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.dtypes.setdefault(tensor.dtype, set()).add(str(func))
        return out


def test_the_npu_path_never_makes_an_fp64_tensor(npu_model, tensors):
    with DtypesMade() as made:
        mixed_forward(npu_model)
    assert torch.float64 not in made.dtypes and torch.float32 in made.dtypes and torch.int8 in made.dtypes
    fp64_path = Transformer(ARGS, tensors, "w8a8", kernel="int_mm", attention="fp64")
    with DtypesMade() as made:  # the detector sees the fp64 path's fp64
        fp64_path(torch.tensor([1, 2, 3]), torch.arange(3), causal(3), KVCache(ARGS, 3))
    assert torch.float64 in made.dtypes


def test_the_fixed_order_path_computes_the_models_function(tensors, cpu_mirror):
    reference = Transformer(ARGS, tensors, "w8a8", kernel="int_mm", attention="fp64")
    prompt = torch.randint(0, ARGS.vocab_size, (40,), generator=torch.Generator().manual_seed(7))
    got = cpu_mirror(prompt, torch.arange(40), causal(40), KVCache(ARGS, 40))
    expected = reference(prompt, torch.arange(40), causal(40), KVCache(ARGS, 40))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_fixed_order_attention_is_softmax_attention_whatever_its_blocks(monkeypatch):
    generator = torch.Generator().manual_seed(6)
    heads, kv_heads, head_dim, start = 6, 2, 16, 150
    tokens, parents, depths, ancestors = small_tree(7, seed=1)
    steps = len(parents)
    keys = torch.randn(kv_heads, start + steps, head_dim, generator=generator)
    values = torch.randn(kv_heads, start + steps, head_dim, generator=generator)
    queries = torch.randn(steps, heads, head_dim, generator=generator)
    visible = fixed_order.VisibleKeys.build(ancestors, start)
    out = fixed_order.attend(queries, keys, values, visible)
    allowed = torch.cat([torch.ones(steps, start, dtype=torch.bool), ancestors], dim=1)
    scores = queries.double().transpose(0, 1) @ keys.double().repeat_interleave(3, 0).transpose(1, 2) / head_dim ** 0.5
    expected = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values.double().repeat_interleave(3, 0))
    torch.testing.assert_close(out.double(), expected.transpose(0, 1).reshape(steps, -1), rtol=1e-5, atol=1e-5)
    for key_block in (1, 4, 16, 256):  # blocks are subtrees of one sum: the same bits
        assert torch.equal(fixed_order.attend(queries, keys, values, visible, key_block), out)
    monkeypatch.setattr(fixed_order, "PRODUCT_BUDGET", 1)  # one query row at a time
    assert torch.equal(fixed_order.attend(queries, keys, values, visible), out)
    assert fixed_order.is_batch_invariant("cpu")


def test_drafted_greedy_generation_on_the_npu_path_is_plain_decoding(npu_model):
    config = VerifierConfig(measure_cost_curve=False, kv_pool_tokens=4096, max_seq_len=256, max_input_tokens=128,
                            batch_wait_ms=0.0)
    engine = Engine(npu_model, None, "tiny", config, device="cpu")  # token ids only: no tokenizer
    prompt = [7, 300, 12, 45, 300, 12, 99]
    try:
        first = engine.prefill("plain", prompt, Sampling(), None).token
        plain = [first]
        while len(plain) < 12:
            plain.append(engine.verify("plain", [], []).bonus_token)
        first = engine.prefill("drafted", prompt, Sampling(), None).token
        drafted, steps = [first], 0
        while len(drafted) < 12:
            # The plain continuation with a wrong sibling and a wrong tail: some accepted.
            truth = plain[len(drafted) : len(drafted) + 3]
            tokens = [*truth, (truth[0] + 1) % ARGS.vocab_size] if truth else []
            result = engine.verify("drafted", tokens, [-1, 0, 1, -1][: len(tokens)])
            drafted += [*result.accepted_tokens, result.bonus_token]
            steps += 1
        assert drafted[:12] == plain and steps < 11
    finally:
        engine.close()


def test_the_reference_product_is_exact_beyond_fp32():
    a = torch.full((2, 1536), 127, dtype=torch.int8)
    b = torch.full((1536, 3), -127, dtype=torch.int8)
    assert torch.equal(npu_quant_matmul(a, b, torch.ones(3), output_dtype=torch.int32).long(), a.long() @ b.long())
