"""The verifier on a CUDA GPU: its int8 GEMM is exact there, a row's result does not depend on
what else is in the batch, and drafted greedy decoding yields exactly plain decoding's tokens.

Skipped on hosts without CUDA. On one with it, `pytest tests/test_verifier_cuda.py` runs these and
`pytest tests/test_end_to_end.py --device cuda` runs the whole gRPC stack with its verifier there.
"""

import copy
import os
import threading

import pytest
import torch

from verifier.acceptance import Sampling
from verifier.config import VerifierConfig
from verifier.engine import Engine
from verifier.kvcache import KVCache
from verifier.model import Transformer
from verifier.quant import W8A8Linear, kernel_is_exact
from verifier.weights import load_checkpoint
from tests.prompts import CHAT_PROMPTS, CODE_PROMPTS, REPETITIVE_PROMPTS
from tests.test_model import clone, make_tree

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")

CUDA = torch.device("cuda")
PROMPTS = [*CODE_PROMPTS, *CHAT_PROMPTS, *REPETITIVE_PROMPTS]


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(None)


@pytest.fixture(scope="module")
def model(checkpoint):
    # As the verifier builds it for --device cuda: the kernel measured, attention "auto" (fp64 off CPU).
    return Transformer.from_checkpoint(checkpoint, "w8a8", device=CUDA)


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=CUDA).tril()


def test_the_int8_kernel_is_exact_on_cuda_and_the_model_uses_an_exact_one(model):
    assert kernel_is_exact("int_mm", CUDA)
    assert model.kernel in ("int_mm", "fp32_exact") and model.attention == "fp64"


@pytest.mark.parametrize("kernel", ["int_mm", "fp32_exact"])
def test_w8a8_linear_on_cuda_is_row_invariant_and_matches_the_cpu_bit_for_bit(kernel):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 1536, generator=generator)
    on_cpu = W8A8Linear(weight, bias=torch.randn(96, generator=generator), kernel=kernel)
    on_gpu = copy.deepcopy(on_cpu).to(CUDA)
    x = torch.randn(64, 1536, generator=generator, dtype=torch.float64) * 5
    full = on_gpu(x.to(CUDA))
    # Rows alone and in batches below, at and above int_mm's 17-row minimum (short inputs are padded).
    for count in (1, 2, 7, 16, 17, 33):
        assert torch.equal(on_gpu(x[:count].to(CUDA)), full[:count])
    assert all(torch.equal(on_gpu(x[i : i + 1].to(CUDA))[0], full[i]) for i in range(0, 64, 7))
    # Integer sums are exact and the scaling is elementwise IEEE arithmetic on both devices.
    assert torch.equal(full.cpu(), on_cpu(x))


def test_rmsnorm_rows_on_cuda_are_the_same_alone_and_in_a_batch(model):
    norm = model.layers[0].attention_norm
    rows = torch.randn(65, model.args.dim, generator=torch.Generator().manual_seed(0)).to(CUDA) * 3
    full = norm(rows)
    for count in (1, 2, 7, 16, 17, 33, 65):
        assert torch.equal(norm(rows[:count]), full[:count])
    assert all(torch.equal(norm(rows[i : i + 1])[0], full[i]) for i in range(65))


def test_a_tree_on_cuda_gives_each_node_the_logits_of_plain_decoding_down_its_path(checkpoint, model):
    prompt = checkpoint.tokenizer.encode_chat("Write a haiku about the sea.")
    base = KVCache(checkpoint.args, 128, device=CUDA)
    base.reserve(len(prompt))
    model(torch.tensor(prompt, device=CUDA), torch.arange(len(prompt), device=CUDA), causal(len(prompt)), base)
    base.commit(torch.arange(len(prompt)))
    tokens, parents, depths, ancestors = make_tree(48, seed=0)
    tokens, depths, ancestors = tokens.to(CUDA), depths.to(CUDA), ancestors.to(CUDA)
    tree_cache = clone(base)
    tree_cache.reserve(len(parents))
    tree_logits = model(tokens, depths, ancestors, tree_cache)
    for leaf in sorted(set(range(len(parents))) - set(parents)):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        cache = clone(base)
        for node in path:  # one token per forward, committed as it goes: plain decoding
            cache.reserve(1)
            logits = model(tokens[node : node + 1], torch.zeros(1, dtype=torch.long, device=CUDA), causal(1), cache)
            cache.commit(torch.tensor([0]))
            assert torch.equal(logits[0], tree_logits[node]), f"node {node} differs from plain decoding"


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
    first, _ = engine.prefill(session_id, prompt, Sampling(), None)
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
    # The same integers in every GEMM, but the fp64 attention sums in another order on each device,
    # and a last-bit difference that crosses an int8 rounding boundary of an activation moves the
    # logits by ~0.1-0.5. So the two engines agree on the next token, not bit for bit; each one is
    # lossless on its own (the tests above).
    on_cpu = Transformer.from_checkpoint(checkpoint, "w8a8", kernel="fp32_exact", attention="fp64")
    agree = total = 0
    for text in PROMPTS:
        prompt = checkpoint.tokenizer.encode_chat(text)
        n = len(prompt)
        cpu_logits = on_cpu(torch.tensor(prompt), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(),
                            KVCache(checkpoint.args, n))
        gpu_logits = model(torch.tensor(prompt, device=CUDA), torch.arange(n, device=CUDA), causal(n),
                           KVCache(checkpoint.args, n, device=CUDA)).cpu()
        agree += int((cpu_logits.argmax(-1) == gpu_logits.argmax(-1)).sum())
        total += n
        print(f"{text[:30]!r}: mean |gpu - cpu| {float((gpu_logits - cpu_logits).abs().mean()):.3f}, "
              f"argmax agrees at {int((cpu_logits.argmax(-1) == gpu_logits.argmax(-1)).sum())} of {n}")
    assert agree >= 0.9 * total, f"next tokens agree at {agree} of {total} positions"
