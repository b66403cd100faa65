"""The CPU engine's C layers (decoder_layer.c): the norm and SwiGLU compute the torch functions, row
by row, and a whole layer in one call gives the Python modules' bits, keys and values included."""

import random

import pytest
import torch
import torch.nn.functional as F

from tests.test_quant import tiny_tensors
from tests.tiny_checkpoints import transformers_model, write_hf
from tests.test_verifier_batching import random_tree
from pardec.verifier.loading import load_model
from pardec.verifier.kernels import native_linear
from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.model.args import ModelArgs
from pardec.verifier.model.step import StepInput
from pardec.verifier.model.transformer import Transformer
from pardec.verifier.model.quant import native_is_exact
from pardec.verifier.model.weights import load_checkpoint

torch.set_num_threads(2)
pytestmark = pytest.mark.skipif(not native_is_exact(), reason="no C compiler, or the native kernel failed its exactness probe")


@pytest.fixture(scope="module")
def kernels():
    return native_linear.load()


@pytest.mark.parametrize("width", [576, 100])  # 100: a tail shorter than a vector
def test_the_norm_and_swiglu_are_torchs_functions_row_by_row(kernels, width):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(20, width, generator=generator) * 3
    weight = 1 + torch.randn(width, generator=generator) * 0.3
    normed = kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(normed, F.rms_norm(x, (width,), weight, 1e-5), rtol=2e-6, atol=2e-6)
    gate_up = torch.randn(20, 2 * width, generator=generator) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    act = kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=5e-6, atol=1e-6)
    for row in (0, 7, 19):  # a row alone: the same bits as in the batch of 20
        assert torch.equal(kernels.rms_norm(x[row : row + 1], weight, 1e-5), normed[row : row + 1])
        assert torch.equal(kernels.silu_mul(gate_up[row : row + 1]), act[row : row + 1])


def forward_with_and_without_fusion(model: Transformer, steps, seed: int):
    """Each session's logits and the pool's keys and values, fused and as modules, from one start."""
    results = []
    for fused in (model.fused_layers, None):
        saved, model.fused_layers = model.fused_layers, fused
        try:
            generator = torch.Generator().manual_seed(seed)
            pool = KVPool(model.args, 2048, 16, dtype=model.kv_dtype)
            pool.kv.zero_()
            sessions = [pool.session() for _ in steps]
            prompts = [torch.randint(3, model.args.vocab_size, (n,), generator=generator) for n in (30, 17, 41)]
            for session, prompt in zip(sessions, prompts):
                session.reserve(len(prompt))
            causal = [torch.ones(len(p), len(p), dtype=torch.bool).tril() for p in prompts]
            prefill = model.forward_batch([StepInput(p, torch.arange(len(p)), c, s)
                                           for p, c, s in zip(prompts, causal, sessions)])
            for session, prompt in zip(sessions, prompts):
                session.commit(torch.arange(len(prompt)))
                session.reserve(max(len(step[0]) for step in steps))
            logits = model.forward_batch([StepInput(*step, session) for step, session in zip(steps, sessions)])
            results.append((prefill + logits, pool.kv.clone()))
        finally:
            model.fused_layers = saved
    return results


def check_fusion_is_exact(model: Transformer):
    assert model.fused_layers is not None
    rng = random.Random(1)
    vocab = model.args.vocab_size
    steps = [random_tree(12, rng, vocab), random_tree(0, rng, vocab), random_tree(30, rng, vocab)]
    (fused_logits, fused_kv), (module_logits, module_kv) = forward_with_and_without_fusion(model, steps, seed=2)
    for index, (fused, modules) in enumerate(zip(fused_logits, module_logits)):
        assert torch.equal(fused, modules), f"output {index} differs between fused layers and modules"
    assert torch.equal(fused_kv, module_kv)


def test_the_default_models_fused_layers_give_the_modules_bits(checkpoint, prepared_weights):
    check_fusion_is_exact(load_model(checkpoint, "w8a8", kernel="native", prepared_cache=prepared_weights))


def test_fused_layers_carry_qwen2s_qkv_bias():
    args = ModelArgs(architecture="qwen2", vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                     rope_theta=1e4, norm_eps=1e-6, max_position=128, tie_embeddings=True, qkv_bias=True)
    model = Transformer(args, tiny_tensors(args), "w8a8", kernel="native", attention="native")
    check_fusion_is_exact(model)


def test_fused_layers_carry_qwen3s_head_norms_and_wide_heads(checkpoint, tmp_path):
    """Qwen3: each q and k head RMS-normalized before rotary, and heads wider than hidden / heads
    (4 x 32 = 128 against 64), so attention's output is wider than the residual stream."""
    directory = write_hf(transformers_model("qwen3"), tmp_path, checkpoint.tokenizer)
    qwen3 = load_checkpoint(str(directory))
    assert qwen3.args.qk_norm and qwen3.args.q_dim == 2 * qwen3.args.dim
    check_fusion_is_exact(load_model(qwen3, "w8a8", kernel="native"))


def test_fused_layers_store_a_bf16_cache_as_the_modules_do(checkpoint, prepared_weights):
    """A bf16 KV pool: each key and value rounded as torch rounds it (to nearest, ties to even)
    when the C layer stores it, read by the bf16 attention kernel: the modules' bits, pool included."""
    model = load_model(checkpoint, "w8a8", kernel="native", prepared_cache=prepared_weights, kv_dtype=torch.bfloat16)
    assert model.kv_dtype == torch.bfloat16 and model.native_attention.kv_dtype == torch.bfloat16
    check_fusion_is_exact(model)
    # A contiguous fp32 cache (tests, tools) beside the pool's sessions: refused, not run on another path.
    from pardec.verifier.model.kv_contiguous import KVCache

    pool, alone = model.new_pool(256, 16), KVCache(model.args, 8)
    session = pool.session()
    session.reserve(3), alone.reserve(3)
    steps = [StepInput(torch.tensor([5, 6, 7]), torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril(), cache)
             for cache in (session, alone)]
    with pytest.raises(ValueError, match="mixes caches the torch.bfloat16 attention kernel reads with others"):
        model.forward_batch(steps)
