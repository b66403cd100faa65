"""The verifier on a CUDA GPU, with the bundled model: the device engine (device_forward.py) keeps
its weights int8, its exact GEMM and every per-row kernel give a row the same bits whatever else
is in the step, and drafted greedy decoding yields exactly plain decoding's tokens.

Skipped on hosts without CUDA. On one with it, `pytest tests/test_verifier_cuda.py
tests/test_device_engine.py --device cuda` runs these and the engine's kernel tests compiled, and
`pytest tests/test_end_to_end.py --device cuda` the whole gRPC stack with its verifier there.
"""

import copy
import os
import threading

import pytest
import torch

from pardec.verifier.loading import load_model
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.step import StepInput
from pardec.verifier.model.quant import W8A8Linear, kernel_is_exact
from pardec.verifier.model.weights import load_checkpoint
from tests.prompts import CHAT_PROMPTS, CODE_PROMPTS, REPETITIVE_PROMPTS
from tests.steps import chain_step, prefill
from tests.test_model import make_tree

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")

CUDA = torch.device("cuda")
PROMPTS = [*CODE_PROMPTS, *CHAT_PROMPTS, *REPETITIVE_PROMPTS]


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(None)


@pytest.fixture(scope="module")
def model(checkpoint):
    # As the verifier builds it for --device cuda: attention "auto" is the device engine there.
    return load_model(checkpoint, "w8a8", device=CUDA)


def test_the_model_runs_the_device_engine_with_int8_weights_and_a_bf16_cache(model):
    assert kernel_is_exact("int_mm", CUDA)
    assert model.attention == "triton" and model.kernel == "int_mm" and model.device_forward is not None
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert linears and all(chunk.dtype == torch.int8 and chunk.is_cuda for m in linears for chunk in m.weight_chunks)
    # No fp32 copy of a linear weight: the float tensors left are norms, scales, rotary tables
    # and the embedding table (a lookup of the step's rows).
    floats = {name: p for name, p in [*model.named_parameters(), *model.named_buffers()] if p.is_floating_point()}
    big = {name for name, p in floats.items() if p.numel() >= model.args.dim * model.args.dim}
    assert big <= {"tok_embeddings", "rope_cos", "rope_signed_sin"}, big
    assert model.new_pool(1024, 32).kv.dtype == torch.bfloat16


def test_w8a8_linear_on_cuda_is_row_invariant_and_matches_the_cpu_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 1536, generator=generator)
    on_cpu = W8A8Linear(weight, bias=torch.randn(96, generator=generator), kernel="int_mm")
    on_gpu = copy.deepcopy(on_cpu).to(CUDA)
    x = torch.randn(64, 1536, generator=generator, dtype=torch.float64) * 5
    full = on_gpu(x.to(CUDA))
    # Rows alone and in batches below, at and above int_mm's 17-row minimum (short inputs are padded).
    for count in (1, 2, 7, 16, 17, 33):
        assert torch.equal(on_gpu(x[:count].to(CUDA)), full[:count])
    assert all(torch.equal(on_gpu(x[i : i + 1].to(CUDA))[0], full[i]) for i in range(0, 64, 7))
    # Integer sums are exact and the scaling is elementwise IEEE arithmetic on both devices.
    assert torch.equal(full.cpu(), on_cpu(x))


def test_each_row_kernel_gives_a_row_the_same_bits_alone_and_among_65(model):
    from pardec.verifier.kernels import triton_layers

    g = torch.Generator().manual_seed(0)
    args = model.args
    rows = 65
    dim, ffn = args.dim, args.ffn_dim

    def run(count):
        h = (torch.randn(rows, dim, generator=torch.Generator().manual_seed(1)) * 3).to(CUDA)[:count].clone()
        x_norm, s_norm = torch.zeros(count, dim, dtype=torch.int8, device=CUDA), torch.zeros(count, device=CUDA)
        triton_layers.residual_norm_quant(h, model.norm.weight, args.norm_eps, x_norm, s_norm, acc=acc_d[:count],
                                    acc_scale=scale[:count], w_scale=w_scale_d)
        out_ffn = torch.zeros(count, ffn, device=CUDA)
        triton_layers.swiglu(acc_f[:count], scale[:count], w_scale_f, out_ffn, 64)
        x_ffn, s_ffn = torch.zeros(count, ffn, dtype=torch.int8, device=CUDA), torch.zeros(count, device=CUDA)
        triton_layers.quant_rows(out_ffn, x_ffn, s_ffn)
        logits = torch.zeros(count, 4096, device=CUDA)
        triton_layers.dequant(acc_v[:count], scale[:count], w_scale_v, logits)
        return h, x_norm, s_norm, out_ffn, x_ffn, s_ffn, logits, logits.argmax(-1)

    acc_d = torch.randint(-2**22, 2**22, (rows, dim), generator=g, dtype=torch.int32).to(CUDA)
    acc_f = torch.randint(-2**22, 2**22, (rows, 2 * ffn), generator=g, dtype=torch.int32).to(CUDA)
    acc_v = torch.randint(-2**22, 2**22, (rows, 4096), generator=g, dtype=torch.int32).to(CUDA)
    scale = (torch.rand(rows, generator=g) * 1e-5).to(CUDA)
    w_scale_d, w_scale_f, w_scale_v = [(torch.rand(n, generator=g) * 1e-3).to(CUDA) for n in (dim, 2 * ffn, 4096)]
    full = run(rows)
    for count in (1, 2, 7, 16, 17, 33, 64):
        for a, b in zip(run(count), full):
            assert torch.equal(a, b[:count])


def test_a_64_node_tree_gives_each_node_plain_decodings_logits(checkpoint, model):
    pool = model.new_pool(8192, 32)
    prompt = checkpoint.tokenizer.encode_chat("Write a haiku about the sea.")
    tokens, parents, depths, ancestors = make_tree(63, seed=0)  # the root and 63 nodes: 64 rows
    base = prefill(model, pool, prompt)
    base.reserve(len(parents))
    tree = model.forward_batch([StepInput(tokens, depths, ancestors, base)])[0]
    for leaf in sorted(set(range(len(parents))) - set(parents))[:12]:
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        cache = prefill(model, pool, prompt)
        for node in reversed(path):  # one token per forward, committed as it goes: plain decoding
            cache.reserve(1)
            logits = model.forward_batch([chain_step(tokens[node : node + 1], cache)])[0]
            cache.commit(torch.tensor([0]))
            assert torch.equal(logits[0], tree[node]), f"node {node} differs from plain decoding"
        cache.free()


def test_a_tree_beside_other_sessions_after_a_chunked_prefill_and_replayed_gets_the_same_bits(checkpoint, model):
    pool = model.new_pool(16384, 32)
    prompt = checkpoint.tokenizer.encode_chat(CODE_PROMPTS[0])
    tokens, parents, depths, ancestors = make_tree(15, seed=1)
    alone_cache = prefill(model, pool, prompt)
    alone_cache.reserve(16)
    alone = model.forward_batch([StepInput(tokens, depths, ancestors, alone_cache)])[0]
    again = model.forward_batch([StepInput(tokens, depths, ancestors, alone_cache)])[0]  # a replayed graph
    assert torch.equal(alone, again)
    rest = len(prompt) - 7
    chunked = prefill(model, pool, prompt, chunks=[7, rest - rest // 2, rest // 2])
    chunked.reserve(16)
    others = [prefill(model, pool, checkpoint.tokenizer.encode_chat(p)) for p in CHAT_PROMPTS[:3]]
    for other in others:
        other.reserve(4)
    batch = [chain_step([11, 12, 13, 14], other) for other in others]
    batch.insert(1, StepInput(tokens, depths, ancestors, chunked))
    beside = model.forward_batch(batch)[1]
    assert torch.equal(alone, beside)
    model.device_forward.use_graphs = False
    try:
        eager = model.forward_batch([StepInput(tokens, depths, ancestors, alone_cache)])[0]
    finally:
        model.device_forward.use_graphs = True
    assert torch.equal(alone, eager)
    assert model.device_forward.graph_replays > 0


def draft_from_history(history: list[int]) -> tuple[list[int], list[int]]:
    """What followed the last two earlier occurrences of the last token, as two chains of up to 6."""
    tokens, parents = [], []
    starts = [i + 1 for i in range(len(history) - 1) if history[i] == history[-1]][-2:]
    for start in starts:
        for depth, token in enumerate(history[start : start + 6]):
            parents.append(-1 if depth == 0 else len(tokens) - 1)
            tokens.append(token)
    return tokens, parents


def generate(engine: Engine, session_id: str, prompt: list[int], new_tokens: int, drafted: bool,
             steps: dict[str, int]) -> list[int]:
    first = engine.prefill(session_id, prompt, Sampling(), None).token
    history, generated = [*prompt, first], [first]
    steps[session_id] = 0
    while len(generated) < new_tokens:
        steps[session_id] += 1
        tokens, parents = draft_from_history(history) if drafted else ([], [])
        result = engine.verify(session_id, tokens, parents)
        step = [*result.accepted_tokens, result.bonus_token]
        history += step
        generated += step
    engine.release(session_id)
    return generated[:new_tokens]


def test_drafted_greedy_sessions_batched_on_cuda_generate_their_plain_tokens(checkpoint, model):
    config = VerifierConfig(measure_cost_curve=False, device="cuda", batch_wait_ms=20.0)
    engine = Engine(model, checkpoint.tokenizer, checkpoint.model_name, config, device="cuda")
    prompts = [checkpoint.tokenizer.encode_chat(p) for p in PROMPTS]
    try:
        steps: dict[str, int] = {}
        plain = [generate(engine, f"plain-{i}", p, 48, False, steps) for i, p in enumerate(prompts)]
        drafted: dict[int, list[int]] = {}

        def run(i):
            drafted[i] = generate(engine, f"drafted-{i}", prompts[i], 48, True, steps)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i in range(len(prompts)):
            assert drafted[i] == plain[i], f"prompt {i} diverged from plain decoding on CUDA"
        drafted_steps = sum(count for name, count in steps.items() if name.startswith("drafted"))
        plain_steps = sum(count for name, count in steps.items() if name.startswith("plain"))
        assert drafted_steps < plain_steps  # drafts were accepted, not all rejected
        assert engine.pool.free_tokens == engine.pool.capacity_tokens
    finally:
        engine.close()


def test_cuda_and_cpu_models_agree_on_the_next_token(checkpoint, model):
    # The same int8 weights, but bf16 keys and values and fp32 attention in other blocks on the
    # GPU: a last-bit difference that crosses an int8 rounding boundary of an activation moves
    # the logits by ~0.1-0.5. So the two engines agree on the next token, not bit for bit; each
    # one is lossless on its own (the tests above).
    # The same int8 weights on the CPU, through the modules (fp64 attention over an fp32 cache).
    engine, model.device_forward = model.device_forward, None
    try:
        on_cpu = copy.deepcopy(model).to("cpu")
    finally:
        model.device_forward = engine
    pool = model.new_pool(8192, 32)
    agree = total = 0
    for text in PROMPTS:
        prompt = checkpoint.tokenizer.encode_chat(text)
        n = len(prompt)
        cpu_logits = on_cpu(torch.tensor(prompt), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(),
                            KVCache(checkpoint.args, n))
        cache = pool.session()
        cache.reserve(n)
        gpu_logits = model.forward_batch([chain_step(prompt, cache)])[0].cpu()
        cache.free()
        agree += int((cpu_logits.argmax(-1) == gpu_logits.argmax(-1)).sum())
        total += n
        print(f"{text[:30]!r}: mean |gpu - cpu| {float((gpu_logits - cpu_logits).abs().mean()):.3f}, "
              f"argmax agrees at {int((cpu_logits.argmax(-1) == gpu_logits.argmax(-1)).sum())} of {n}")
    assert agree >= 0.9 * total, f"next tokens agree at {agree} of {total} positions"
