"""Lossless sampling: with drafted trees that hold the likely tokens, the first generated tokens
are distributed exactly as in plain sampling (chi-square on many seeded samples), and the same
seed gives the same tokens with and without drafting."""

import os
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model.kv_contiguous import KVCache

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

SAMPLING = Sampling(temperature=1.0, top_k=4)
SAMPLES = 256  # per arm
PROMPT = "Pick a number between 1 and 3. Answer with the number only."


@pytest.fixture(scope="module")
def setup(checkpoint, model):
    config = VerifierConfig(measure_cost_curve=False, batch_wait_ms=5.0)
    engine = Engine(model, checkpoint.tokenizer, checkpoint.model_name, config)
    yield checkpoint, model, engine
    engine.close()


def chi_square_homogeneity(table: list[list[int]]) -> tuple[float, int, float]:
    """Pearson's chi-square test that the rows of a contingency table share one distribution:
    (statistic, degrees of freedom, p-value); the p-value is the chi-square survival function,
    the regularized upper incomplete gamma Q(dof / 2, statistic / 2)."""
    observed = torch.tensor(table, dtype=torch.float64)
    expected = observed.sum(1, keepdim=True) * observed.sum(0, keepdim=True) / observed.sum()
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = (observed.shape[0] - 1) * (observed.shape[1] - 1)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, dof, p_value


def test_chi_square_helper_matches_known_values():
    # 2 x 2 table with a textbook answer: statistic 4.0 on 1 dof, p = 0.0455.
    statistic, dof, p_value = chi_square_homogeneity([[30, 20], [20, 30]])
    assert dof == 1 and abs(statistic - 4.0) < 1e-9 and abs(p_value - 0.0455) < 1e-4
    assert chi_square_homogeneity([[10, 20, 30], [10, 20, 30]])[2] == pytest.approx(1.0)


def top_tokens(model, checkpoint, prefix: list[int], k: int) -> list[int]:
    cache = KVCache(checkpoint.args, len(prefix))
    count = len(prefix)
    logits = model(torch.tensor(prefix), torch.arange(count), torch.ones(count, count, dtype=torch.bool).tril(), cache,
                   output_rows=torch.tensor([count - 1]))
    return torch.topk(logits[0], k).indices.tolist()


def draft_trees(model, checkpoint, prompt: list[int]) -> dict[int, tuple[list[int], list[int]]]:
    """For every possible first token: a fixed tree of the 3 likeliest second tokens, each with
    its 2 likeliest third tokens -- computed from the model once, never from the samples."""
    trees = {}
    for first in top_tokens(model, checkpoint, prompt, SAMPLING.top_k):
        tokens, parents = [], []
        for second in top_tokens(model, checkpoint, prompt + [first], 3):
            parents.append(-1)
            tokens.append(second)
            parent = len(tokens) - 1
            for third in top_tokens(model, checkpoint, prompt + [first, second], 2):
                parents.append(parent)
                tokens.append(third)
        trees[first] = (tokens, parents)
    return trees


def sample(engine, prompt, seed, trees=None) -> tuple[tuple[int, int, int], int]:
    """The first three generated tokens, and how many draft nodes were accepted."""
    session = f"sample-{seed}-{trees is not None}"
    first = engine.prefill(session, prompt, SAMPLING, seed).token
    generated, accepted = [first], 0
    try:
        while len(generated) < 3:
            tokens, parents = trees.get(first, ([], [])) if trees and len(generated) == 1 else ([], [])
            result = engine.verify(session, tokens, parents)
            accepted += len(result.accepted_tokens)
            generated += [*result.accepted_tokens, result.bonus_token]
    finally:
        engine.release(session)
    return tuple(generated[:3]), accepted


def test_drafted_sampling_is_distributed_as_plain_sampling(setup):
    checkpoint, model, engine = setup
    prompt = checkpoint.tokenizer.encode_chat(PROMPT)
    trees = draft_trees(model, checkpoint, prompt)
    with ThreadPoolExecutor(16) as pool:
        plain = list(pool.map(lambda s: sample(engine, prompt, s)[0], range(SAMPLES)))
        drafted = list(pool.map(lambda s: sample(engine, prompt, s, trees), range(SAMPLES, 2 * SAMPLES)))
    accepted = sum(a for _, a in drafted)
    drafted = [tokens for tokens, _ in drafted]
    # The trees must matter: most second tokens come out of the draft, not as bonus tokens.
    assert accepted > SAMPLES, f"only {accepted} draft tokens accepted in {SAMPLES} samples"

    counts = [Counter(plain), Counter(drafted)]
    frequent = sorted(k for k in counts[0].keys() | counts[1].keys() if counts[0][k] + counts[1][k] >= 10)
    table = [[c[k] for k in frequent] + [SAMPLES - sum(c[k] for k in frequent)] for c in counts]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 4, f"too few distinct outcomes to test: {counts}"
    statistic, dof, p_value = chi_square_homogeneity(table)
    print(f"\nchi-square {statistic:.2f}, {dof} dof, p = {p_value:.3f}; {accepted} draft tokens accepted")
    assert p_value > 0.01, f"plain vs drafted first-token distributions differ: {table}"


def test_same_seed_same_tokens_with_and_without_drafting(setup):
    checkpoint, model, engine = setup
    prompt = checkpoint.tokenizer.encode_chat(PROMPT)
    trees = draft_trees(model, checkpoint, prompt)
    seeds = random.Random(0).sample(range(10**6), 12)
    with ThreadPoolExecutor(12) as pool:
        plain = list(pool.map(lambda s: sample(engine, prompt, s)[0], seeds))
        drafted = list(pool.map(lambda s: sample(engine, prompt, s, trees)[0], seeds))
    assert plain == drafted
