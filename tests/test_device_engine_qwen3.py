"""The device engine on Qwen3's layout: each q and k head RMS-normalized on its own before rotary,
inside the q/k/v kernel (triton_layers.qkv_rotary_store). The kernel against torch, the forward
against transformer.py's modules, and a tree row's logits bit-identical to plain decoding's down
its path, alone and beside another session. On CPU under Triton's interpreter; `--device cuda`
on a GPU."""

import pytest
import torch

from pardec.verifier.model.args import ModelArgs
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.model.step import StepInput
from pardec.verifier.model.transformer import Transformer
from tests.steps import assert_nodes_are_plain_decoding, causal, chain_step, prefill
from tests.test_quant import tiny_tensors

triton = pytest.importorskip("triton")

from pardec.verifier.kernels import triton_layers  # noqa: E402

ARGS = ModelArgs(architecture="qwen3", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                 rope_theta=1e4, norm_eps=1e-6, max_position=256, tie_embeddings=True, qkv_bias=False, qk_norm=True)


@pytest.fixture(scope="module")
def tensors():
    tensors = tiny_tensors(ARGS)
    generator = torch.Generator().manual_seed(3)
    for layer in range(ARGS.n_layers):
        for name in ("q_norm", "k_norm"):
            tensors[f"layers.{layer}.attention.{name}.weight"] = 1 + 0.3 * torch.randn(ARGS.head_dim, generator=generator)
    return tensors


@pytest.fixture(scope="module")
def model(tensors, on):
    return Transformer(ARGS, tensors, "w8a8", kernel="int_mm", attention="triton").to(on)


def test_the_qkv_kernel_normalizes_each_q_and_k_head_before_rotary(model, on):
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim = ARGS.n_heads, ARGS.n_kv_heads, ARGS.head_dim
    width = (heads + 2 * kv_heads) * head_dim
    rows = 3
    acc = torch.randint(-2**14, 2**14, (rows, width), generator=g, dtype=torch.int32)
    x_scale, w_scale = torch.rand(rows, generator=g), torch.rand(width, generator=g) * 1e-3
    q_norm, k_norm = 1 + torch.randn(head_dim, generator=g) * 0.3, 1 + torch.randn(head_dim, generator=g) * 0.3
    positions, slots = torch.tensor([0, 7, 200], dtype=torch.int32), torch.tensor([5, 0, 9], dtype=torch.int32)
    q = torch.zeros(rows, heads * head_dim, device=on)
    keys, values = torch.zeros(kv_heads, 16, head_dim, device=on), torch.zeros(kv_heads, 16, head_dim, device=on)
    triton_layers.qkv_rotary_store(acc.to(on), x_scale.to(on), w_scale.to(on), None, positions.to(on),
                                   model.rope_cos, model.rope_signed_sin, slots.to(on), q, keys, values, heads,
                                   kv_heads, q_norm.to(on), k_norm.to(on), ARGS.norm_eps)
    q, keys, values = (t.cpu() for t in (q, keys, values))
    x = (acc.float() * x_scale[:, None] * w_scale).view(rows, -1, head_dim)
    weights = torch.stack([q_norm] * heads + [k_norm] * kv_heads)  # [H + KV, HD]
    qk = x[:, : heads + kv_heads]
    normed = qk / (qk.pow(2).mean(-1, keepdim=True) + ARGS.norm_eps).sqrt() * weights
    cos = model.rope_cos.cpu()[positions.long()][:, None]
    sin = model.rope_signed_sin.cpu()[positions.long()][:, None]
    rotated = normed * cos + normed.roll(head_dim // 2, dims=-1) * sin
    torch.testing.assert_close(q, rotated[:, :heads].reshape(rows, -1))
    for row, slot in enumerate(slots.tolist()):
        torch.testing.assert_close(keys[:, slot], rotated[row, heads:])
        torch.testing.assert_close(values[:, slot], x[row, heads + kv_heads :])  # values are not normed


def test_the_device_forward_computes_the_qwen3_modules_function(tensors, model, on):
    reference = Transformer(ARGS, tensors, "w8a8", kernel="int_mm", attention="fp64")
    prompt = torch.randint(0, ARGS.vocab_size, (17,), generator=torch.Generator().manual_seed(7))
    cache = KVPool(ARGS, 256, 16, device=on, dtype=torch.float32).session()
    cache.reserve(len(prompt))
    got = model.forward_batch([chain_step(prompt, cache)])[0].cpu()
    expected = reference(prompt, torch.arange(17), causal(17), KVCache(ARGS, 17))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_a_qwen3_tree_row_gets_plain_decodings_logits_alone_and_beside_a_session(model):
    pool = model.new_pool(1024, 8)
    prompt = torch.randint(0, ARGS.vocab_size, (11,), generator=torch.Generator().manual_seed(9)).tolist()
    tokens = torch.tensor([3, 40, 41, 77])  # root -> 40 -> 41, root -> 77
    parents = [-1, 0, 1, 0]
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    depths = torch.tensor([0, 1, 2, 1])
    whole = prefill(model, pool, prompt)
    whole.reserve(4)
    alone = model.forward_batch([StepInput(tokens, depths, ancestors, whole)])[0]
    beside = prefill(model, pool, prompt, chunks=[4, 7])
    other = prefill(model, pool, prompt[:6])
    beside.reserve(4)
    other.reserve(2)
    batched = model.forward_batch([chain_step([9, 10], other), StepInput(tokens, depths, ancestors, beside)])[1]
    assert torch.equal(alone, batched)
    assert_nodes_are_plain_decoding(model, pool, prompt, tokens, parents, alone)


def test_a_long_stated_context_sizes_the_attention_scratch_by_the_pool(tensors, on):
    """YaRN states 131072 positions (rotary.py); the device engine's attention scratch and block
    table are sized by what a row can see, at most the pool's capacity, not by that."""
    from dataclasses import replace

    from pardec.verifier.kernels import triton_attention
    from pardec.verifier.model.args import RopeScaling

    args = replace(ARGS, max_position=1 << 17, rope_scaling=RopeScaling("yarn", 4.0, 1 << 15, attention_factor=1.1))
    model = Transformer(args, tensors, "w8a8", kernel="int_mm", attention="triton").to(on)
    pool = model.new_pool(1024, 8)
    prefill(model, pool, list(range(5, 30)))
    buffers = model.device_forward._buffers
    assert buffers.max_keys == pool.capacity_tokens == 1024 and buffers.table_width == 1024 // 8 + 1
    expected = triton_attention.attention_scratch(buffers.rows, args.n_kv_heads, args.n_heads, args.head_dim, 1024, on)
    assert buffers.attention_scratch.numel() == expected.numel()
