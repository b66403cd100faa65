"""The device engine (verifier/device_forward.py, triton_layers.py, triton_attention.py): each kernel against a torch
reference, the whole forward against transformer.py's modules, and the batch invariance that makes tree
verification lossless -- a row's logits bit-identical alone, in a tree, beside other sessions,
padded into a bucket and in a chunked prefill.

By default on CPU tensors, under Triton's interpreter; `pytest tests/test_device_engine.py --device
cuda` runs the same tests with the compiled kernels and CUDA graphs on a GPU, where
tests/test_verifier_cuda.py adds the real model. A small random model keeps the interpreter's time
short.
"""

import random

import pytest
import torch

from tests.steps import assert_nodes_are_plain_decoding, causal, chain_step, prefill
from tests.test_quant import tiny_tensors
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.model.device_forward import padded_rows
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.model.args import ModelArgs
from pardec.verifier.model.transformer import Transformer
from pardec.verifier.model.quant import block_hadamard
from pardec.verifier.model.step import StepInput

triton = pytest.importorskip("triton")

from pardec.verifier.kernels import triton_attention, triton_layers  # noqa: E402

ARGS = ModelArgs(architecture="qwen2", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                 rope_theta=1e4, norm_eps=1e-6, max_position=256, tie_embeddings=True, qkv_bias=True)


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def tensors():
    tensors = tiny_tensors(ARGS)
    for layer in range(ARGS.n_layers):  # down_proj's online rotation, as the preconditioned models have
        tensors[f"layers.{layer}.feed_forward.w2.input_hadamard"] = torch.tensor(64)
    return tensors


@pytest.fixture(scope="module")
def model(tensors, on):
    return Transformer(ARGS, tensors, "w8a8", kernel="int_mm", attention="triton").to(on)


def cpu_results(*tensors):
    return [t.cpu() for t in tensors]


def small_tree(n_nodes: int, seed: int):
    rng = random.Random(seed)
    parents = [-1] + [0 if node <= 2 else rng.randrange(0, node) for node in range(1, n_nodes + 1)]
    ancestors = torch.eye(n_nodes + 1, dtype=torch.bool)
    depths = torch.zeros(n_nodes + 1, dtype=torch.long)
    for node in range(1, n_nodes + 1):
        ancestors[node] |= ancestors[parents[node]]
        depths[node] = depths[parents[node]] + 1
    tokens = torch.tensor([rng.randrange(ARGS.vocab_size) for _ in parents])
    return tokens, parents, depths, ancestors


# ---- kernels against torch ---------------------------------------------------------------------

def quantize_reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (y.abs().amax(dim=-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    v = y / scale[:, None]
    return torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(0.5 - v)), scale


def test_residual_norm_quant_adds_the_dequantized_sums_then_norms_and_quantizes_each_row(on):
    g = generator()
    rows, width = 7, 200
    h = torch.randn(rows, width, generator=g) * 3
    acc = torch.randint(-2**20, 2**20, (rows, width), generator=g, dtype=torch.int32)
    acc_scale, w_scale = torch.rand(rows, generator=g) * 1e-3, torch.rand(width, generator=g) * 1e-3
    weight = torch.rand(width, generator=g) + 0.5
    expected_h = h + acc.float() * acc_scale[:, None] * w_scale
    h, q, q_scale = h.to(on), torch.zeros(rows, width, dtype=torch.int8, device=on), torch.zeros(rows, device=on)
    triton_layers.residual_norm_quant(h, weight.to(on), 1e-6, q, q_scale, acc=acc.to(on), acc_scale=acc_scale.to(on),
                                w_scale=w_scale.to(on))
    h, q, q_scale = cpu_results(h, q, q_scale)
    torch.testing.assert_close(h, expected_h)
    values, scale = quantize_reference(torch.nn.functional.rms_norm(expected_h, (width,), weight, 1e-6))
    torch.testing.assert_close(q_scale, scale)
    assert (q.float() - values).abs().max() <= 1  # a value at a rounding boundary may round either way
    assert (q.float() != values).float().mean() < 0.01


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])  # --embedding-dtype
def test_the_first_norm_reads_the_embedding_rows_of_the_tokens(on, table_dtype):
    g = generator(1)
    table = torch.randn(50, 64, generator=g).to(table_dtype)
    tokens = torch.tensor([3, 49, 0, 3], dtype=torch.int32)
    h = torch.zeros(4, 64, device=on)
    q, q_scale = torch.zeros(4, 64, dtype=torch.int8, device=on), torch.zeros(4, device=on)
    triton_layers.residual_norm_quant(h, torch.ones(64, device=on), 1e-6, q, q_scale, embedding=table.to(on),
                                tokens=tokens.to(on))
    h, q, q_scale = cpu_results(h, q, q_scale)
    assert h.dtype == torch.float32 and torch.equal(h, table[tokens.long()].float())
    assert torch.equal(q[0], q[3]) and torch.equal(q_scale[0], q_scale[3])


def test_quant_rows_quantizes_rows_longer_than_one_block(on):
    x = torch.randn(3, 5000, generator=generator(2)) * 4
    x[1] = 0  # an all-zero row stays zero, with a finite scale
    q, scale = torch.zeros(3, 5000, dtype=torch.int8, device=on), torch.zeros(3, device=on)
    triton_layers.quant_rows(x.to(on), q, scale)
    q, scale = cpu_results(q, scale)
    values, expected = quantize_reference(x)
    torch.testing.assert_close(scale, expected)
    assert (q.float() - values).abs().max() <= 1 and not q[1].any()


@pytest.mark.parametrize("hadamard", [0, 64])
def test_swiglu_dequantizes_gate_and_up_and_applies_the_online_hadamard(hadamard, on):
    g = generator(3)
    rows, ffn = 5, 192
    acc = torch.randint(-2**16, 2**16, (rows, 2 * ffn), generator=g, dtype=torch.int32)
    x_scale, w_scale = torch.rand(rows, generator=g) * 1e-4, torch.rand(2 * ffn, generator=g) * 1e-4
    out = torch.zeros(rows, ffn, device=on)
    triton_layers.swiglu(acc.to(on), x_scale.to(on), w_scale.to(on), out, hadamard)
    out = out.cpu()
    gate_up = acc.double() * x_scale.double()[:, None] * w_scale.double()
    expected = torch.nn.functional.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
    if hadamard:
        expected = block_hadamard(expected, hadamard)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_dequant_scales_each_sum_by_its_row_and_column(on):
    g = generator(4)
    acc = torch.randint(-2**20, 2**20, (3, 2000), generator=g, dtype=torch.int32)
    x_scale, w_scale = torch.rand(3, generator=g), torch.rand(2000, generator=g)
    out = torch.zeros(3, 2000, device=on)
    triton_layers.dequant(acc.to(on), x_scale.to(on), w_scale.to(on), out)
    assert torch.equal(out.cpu(), acc.float() * x_scale[:, None] * w_scale)


def test_qkv_rotary_store_rotates_q_and_k_and_stores_keys_and_values_at_their_slots(model, on):
    g = generator(5)
    heads, kv_heads, head_dim = ARGS.n_heads, ARGS.n_kv_heads, ARGS.head_dim
    width = (heads + 2 * kv_heads) * head_dim
    rows = 3
    acc = torch.randint(-2**14, 2**14, (rows, width), generator=g, dtype=torch.int32)
    x_scale, w_scale, bias = torch.rand(rows, generator=g), torch.rand(width, generator=g) * 1e-3, torch.randn(width, generator=g)
    positions, slots = torch.tensor([0, 7, 200], dtype=torch.int32), torch.tensor([5, 0, 9], dtype=torch.int32)
    q = torch.zeros(rows, heads * head_dim, device=on)
    keys, values = torch.zeros(kv_heads, 16, head_dim, device=on), torch.zeros(kv_heads, 16, head_dim, device=on)
    triton_layers.qkv_rotary_store(acc.to(on), x_scale.to(on), w_scale.to(on), bias.to(on), positions.to(on),
                             model.rope_cos, model.rope_signed_sin, slots.to(on), q, keys, values, heads, kv_heads)
    q, keys, values = cpu_results(q, keys, values)
    x = (acc.float() * x_scale[:, None] * w_scale + bias).view(rows, -1, head_dim)
    rope_cos, rope_sin = model.rope_cos.cpu(), model.rope_signed_sin.cpu()
    cos, sin = rope_cos[positions.long()][:, None], rope_sin[positions.long()][:, None]
    rotated = x * cos + x.roll(head_dim // 2, dims=-1) * sin
    torch.testing.assert_close(q, rotated[:, :heads].reshape(rows, -1))
    for row, slot in enumerate(slots.tolist()):
        torch.testing.assert_close(keys[:, slot], rotated[row, heads : heads + kv_heads])
        torch.testing.assert_close(values[:, slot], x[row, heads + kv_heads :])


def attention_reference(q, keys, values, start, ancestors, heads):
    """fp64 softmax attention of step rows over [0, start) and their ancestors among the step's keys."""
    steps = ancestors.shape[0]
    allowed = torch.cat([torch.ones(steps, start, dtype=torch.bool), ancestors], dim=1)
    qh = q.double().view(steps, heads, -1).transpose(0, 1)  # [H, T, HD]
    group = heads // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)  # [H, start + T, HD]
    v = values.double().repeat_interleave(group, 0)
    scores = qh @ k.transpose(1, 2) / qh.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(steps, -1)


@pytest.fixture(params=[dict(), dict(chunk=16, block_n=16), dict(chunk=16, products="ieee", block_n=16),
                        dict(chunk=128, products="sum", block_n=None)],
                ids=["the engine's", "chunks of 16", "tl.dot fp32", "broadcast and sum"])
def attention_tuning(request):
    """Runs a test with the engine's attention tuning, with a small chunk of keys (several chunks a
    row), and with the products made the other ways bench.device times."""
    saved = dict(triton_attention.ATTENTION_TUNING)
    triton_attention.ATTENTION_TUNING.update(request.param)
    yield request.param
    triton_attention.ATTENTION_TUNING.clear()
    triton_attention.ATTENTION_TUNING.update(saved)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tree_attention_matches_softmax_attention_over_scattered_cache_blocks(dtype, on, attention_tuning):
    g = generator(6)
    heads, kv_heads, head_dim, block = 6, 2, 16, 4
    start, steps = 21, 7
    tokens, parents, depths, ancestors = small_tree(steps - 1, seed=1)
    slots_total = 64
    keys = torch.randn(kv_heads, slots_total, head_dim, generator=g).to(dtype)
    values = torch.randn(kv_heads, slots_total, head_dim, generator=g).to(dtype)
    blocks = [9, 2, 14, 5, 0, 11, 7, 3]  # positions 0..31 through scattered blocks
    positions = torch.arange(start + steps)
    position_slots = torch.tensor(blocks)[positions // block] * block + positions % block
    q = torch.randn(steps, heads * head_dim, generator=g)
    out = torch.zeros_like(q)
    table = torch.tensor([blocks], dtype=torch.int32)
    # Each row's ancestors in the step, ascending, itself last; the chain form reads none.
    lists = [torch.nonzero(row).view(-1) for row in ancestors]
    flat = torch.cat(lists).to(torch.int32)
    sizes = torch.tensor([len(x) for x in lists])
    at = (torch.cumsum(sizes, 0) - sizes).to(torch.int32)
    i32 = dict(dtype=torch.int32, device=on)
    keys, values, table, flat, out = keys.to(on), values.to(on), table.to(on), flat.to(on), out.to(on)
    triton_attention.tree_attention(
        q.to(on), keys, values, out, torch.full((steps,), start, **i32), (sizes - 1).to(on, torch.int32),
        torch.zeros(steps, **i32), flat, at.to(on), table, heads, block,
    )
    out, keys, values = cpu_results(out, keys, values)
    expected = attention_reference(q, keys[:, position_slots], values[:, position_slots], start, ancestors, heads)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    causal_out = torch.zeros_like(q, device=on)
    triton_attention.tree_attention(
        q.to(on), keys.to(on), values.to(on), causal_out, torch.full((steps,), start, **i32),
        torch.arange(steps, **i32), torch.zeros(steps, **i32), flat, torch.full((steps,), -1, **i32), table,
        heads, block,
    )
    causal_out = causal_out.cpu()
    expected = attention_reference(q, keys[:, position_slots], values[:, position_slots], start, causal(steps), heads)
    torch.testing.assert_close(causal_out.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_tree_row_attends_to_the_sequence_that_plain_decoding_of_its_path_sees(on, attention_tuning):
    # Row 3 of a tree whose ancestors are step rows 0, 2, 3, after 40 committed keys, against the
    # same keys committed in that order (a 1-row step after 42 committed): the same bits.
    g = generator(10)
    heads, kv_heads, head_dim, block = 4, 2, 16, 8
    keys = torch.randn(kv_heads, 128, head_dim, generator=g).to(torch.bfloat16)
    values = torch.randn(kv_heads, 128, head_dim, generator=g).to(torch.bfloat16)
    q = torch.randn(1, heads * head_dim, generator=g)
    tree_blocks = list(range(8))  # positions 0..39 committed, step rows 0..3 at 40..43
    plain_blocks = [8, 9, 10, 11, 12, 13, 14, 15]
    for position in range(40):  # the committed prefix, copied to the plain session's slots
        keys[:, 64 + position], values[:, 64 + position] = keys[:, position], values[:, position]
    for index, row in enumerate([0, 2, 3]):  # the path, committed in order: positions 40, 41, 42
        keys[:, 64 + 40 + index], values[:, 64 + 40 + index] = keys[:, 40 + row], values[:, 40 + row]
    i32 = dict(dtype=torch.int32, device=on)
    table = torch.tensor([tree_blocks, plain_blocks], dtype=torch.int32).to(on)
    keys, values = keys.to(on), values.to(on)
    outs = []
    for start, depth, session, anc_at in ((40, 2, 0, 0), (42, 0, 1, -1)):
        out = torch.zeros(1, heads * head_dim, device=on)
        triton_attention.tree_attention(q.to(on), keys, values, out, torch.tensor([start], **i32), torch.tensor([depth], **i32),
                               torch.tensor([session], **i32), torch.tensor([0, 2, 3], **i32),
                               torch.tensor([anc_at], **i32), table, heads, block)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])


# ---- the whole forward ---------------------------------------------------------------------------

def test_the_device_forward_computes_the_modules_function(tensors, model, on):
    # With fp32 storage the only differences are fp32 rounding (attention's block order, the
    # Hadamard as a product): the logits agree to float precision.
    reference = Transformer(ARGS, tensors, "w8a8", kernel="int_mm", attention="fp64")
    prompt = torch.randint(0, ARGS.vocab_size, (19,), generator=generator(7))
    pool = KVPool(ARGS, 256, 16, device=on, dtype=torch.float32)
    cache = pool.session()
    cache.reserve(len(prompt))
    got = model.forward_batch([chain_step(prompt, cache)])[0].cpu()
    expected = reference(prompt, torch.arange(19), causal(19), KVCache(ARGS, 19))
    assert model.device_forward.eager_runs and got.shape == (19, ARGS.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_the_default_pool_is_bf16_and_its_logits_stay_close_to_fp32_storage(model, on):
    prompt = torch.randint(0, ARGS.vocab_size, (12,), generator=generator(8))
    assert model.kv_dtype == torch.bfloat16 and model.new_pool(256, 16).kv.dtype == torch.bfloat16
    logits = {}
    for dtype in (torch.bfloat16, torch.float32):
        cache = KVPool(ARGS, 256, 16, device=on, dtype=dtype).session()
        cache.reserve(12)
        logits[dtype] = model.forward_batch([chain_step(prompt, cache)])[0]
    assert (logits[torch.bfloat16].argmax(-1) == logits[torch.float32].argmax(-1)).float().mean() >= 0.9


def test_tree_rows_get_plain_decodings_logits_alone_beside_sessions_padded_and_after_chunked_prefill(
        model, attention_tuning):
    pool = model.new_pool(1024, 8)
    prompt = torch.randint(0, ARGS.vocab_size, (13,), generator=generator(9)).tolist()
    tokens, parents, depths, ancestors = small_tree(6, seed=2)
    tree_step = lambda cache: StepInput(tokens, depths, ancestors, cache)  # noqa: E731

    whole = prefill(model, pool, prompt)
    whole.reserve(len(parents))
    alone = model.forward_batch([tree_step(whole)])[0]

    # The same prompt cached in chunks, and the tree verified beside another session's step.
    chunked = prefill(model, pool, prompt, chunks=[5, 1, 7])
    other = prefill(model, pool, prompt[:9])
    chunked.reserve(len(parents))
    other.reserve(3)
    batched = model.forward_batch([chain_step([4, 5, 6], other), tree_step(chunked)])[1]
    assert torch.equal(alone, batched)

    # Padded into a bucket with padding rows (as always on CUDA) and run eagerly (on CUDA the
    # steps above replayed captured graphs, but for each bucket's first).
    model.device_forward.bucket_on_cpu, model.device_forward.use_graphs = True, False
    try:
        padded_cache = prefill(model, pool, prompt)
        padded_cache.reserve(len(parents))
        padded = model.forward_batch([tree_step(padded_cache)])[0]
    finally:
        model.device_forward.bucket_on_cpu, model.device_forward.use_graphs = False, True
    assert torch.equal(alone, padded)

    # Each node's logits are plain decoding's down its path: one token per step, committed.
    assert_nodes_are_plain_decoding(model, pool, prompt, tokens, parents, alone)


def test_padding_rows_reach_their_bucket_and_no_session_block():
    assert [padded_rows(n, True) for n in (1, 17, 32, 33, 512, 513, 700)] == [32, 32, 32, 64, 512, 520, 704]
    pool = KVPool(ARGS, 64, 16)
    assert pool.scratch_block == pool.n_blocks and pool.scratch_block not in pool.allocate(pool.n_blocks, "all")


def test_drafted_greedy_generation_through_the_device_engine_is_plain_decoding(model, on):
    config = VerifierConfig(measure_cost_curve=False, kv_pool_tokens=4096, max_seq_len=256, max_input_tokens=128,
                            batch_wait_ms=0.0)
    engine = Engine(model, None, "tiny", config, device=str(on))  # token ids only: no tokenizer
    prompt = [7, 300, 12, 45, 300, 12, 99]
    try:
        first = engine.prefill("plain", prompt, Sampling(), None).token
        plain = [first]
        while len(plain) < 10:
            plain.append(engine.verify("plain", [], []).bonus_token)
        first = engine.prefill("drafted", prompt, Sampling(), None).token
        drafted, steps = [first], 0
        while len(drafted) < 10:
            # Draft the plain continuation with a wrong sibling and a wrong tail: some accepted.
            truth = plain[len(drafted) : len(drafted) + 3]
            tokens = [*truth, (truth[0] + 1) % ARGS.vocab_size] if truth else []
            parents = [-1, 0, 1, -1][: len(tokens)]
            result = engine.verify("drafted", tokens, parents)
            drafted += [*result.accepted_tokens, result.bonus_token]
            steps += 1
        assert drafted[:10] == plain and steps < 9
        assert engine.release("plain") and engine.release("drafted")
        assert engine.pool.free_tokens == engine.pool.capacity_tokens
    finally:
        engine.close()


def test_a_cached_prefix_on_the_device_engine_changes_no_token(model, on):
    """Prefix caching on the device engine: a prompt's blocks, and a released session's prompt
    and answer, computed once and found again (bf16 keys and values, as stored), give the
    tokens a cold prefill gives (a scope of its own finds nothing cached)."""
    config = VerifierConfig(measure_cost_curve=False, kv_pool_tokens=4096, kv_block_tokens=16, max_seq_len=256,
                            max_input_tokens=128, batch_wait_ms=0.0)
    engine = Engine(model, None, "tiny", config, device=str(on))
    prompt = [(7 + 31 * i) % ARGS.vocab_size for i in range(40)]

    def generate(session: str, tokens: list[int], scope: str = "") -> tuple[list[int], int]:
        first = engine.prefill(session, tokens, Sampling(), None, cache_scope=scope)
        out = [first.token] + [engine.verify(session, [], []).bonus_token for _ in range(9)]
        engine.release(session)
        return out, first.cached_tokens

    try:
        answer, cached = generate("first", prompt)
        assert cached == 0
        assert generate("again", prompt) == (answer, 32)
        next_turn = prompt + answer + [5, 6, 7]
        assert generate("next-turn", next_turn) == (generate("cold", next_turn, scope="cold")[0], 48)
    finally:
        engine.close()


def test_attention_tunings_parse_checked_and_bench_device_chooses_the_fastest():
    from pardec.bench.device import ATTENTION_VARIANTS, choose_attention, tuning_text

    for variant in ATTENTION_VARIANTS:  # what bench.device hands the tests' --attention-tuning
        assert triton_attention.parse_attention_tuning(tuning_text(variant)) == variant
    for bad in ("chunk=100", "products=tf32", "warps=4", "block_n=-8"):
        with pytest.raises(ValueError, match="attention tuning"):
            triton_attention.parse_attention_tuning(bad)
    timings = {"a": {"1x1": 2.0, "64x1": 3.3}, "b": {"1x1": 2.1, "64x1": 2.6}, "c": {"1x1": 1.9, "64x1": 3.5}}
    assert choose_attention(timings) == "b"
