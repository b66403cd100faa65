"""The step plan's fast paths compute exactly what the plain per-session path does: one store for
every pooled session, sessions of different caches and pools mixed in one forward (one attention
kernel call per session then); and the step-cost benchmark runs."""

import os
import random

import torch

from pardec.bench.verifier_steps import step_costs
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.model.step import StepInput
from pardec.verifier.model.step import StepPlan
from tests.test_verifier_batching import causal, random_tree

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)


def test_the_pool_returns_exactly_the_fp32_values_as_fp64(checkpoint):
    args = checkpoint.args
    pool = KVPool(args, 256, 16)
    cache = pool.session()
    cache.reserve(5)
    cache.begin_step(5)
    kv = torch.randn(5, 2 * args.n_kv_heads, args.head_dim)
    cache.store(3, kv)
    keys, values = cache.load(3, 5)
    assert keys.shape == values.shape == (1, args.n_kv_heads, 5, args.head_dim)
    assert keys.dtype == values.dtype == torch.float64
    assert torch.equal(keys[0].transpose(0, 1), kv[:, : args.n_kv_heads].double())
    assert torch.equal(values[0].transpose(0, 1), kv[:, args.n_kv_heads :].double())


def test_sessions_of_different_caches_in_one_forward_match_each_alone(checkpoint, model):
    """A KVCache and sessions of two pools in one forward: the plan falls back to storing per
    session, and every session's logits are bit-identical to its own forward in a KVCache."""
    rng = random.Random(3)
    args = checkpoint.args
    first_pool, second_pool = KVPool(args, 1024, 16), KVPool(args, 1024, 16)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (40, 57, 23)]
    alone = [KVCache(args, len(p) + 32) for p in prompts]
    mixed = [KVCache(args, len(prompts[0]) + 32), first_pool.session(), second_pool.session()]
    for tokens, reference, cache in zip(prompts, alone, mixed):
        step = (torch.tensor(tokens), torch.arange(len(tokens)), causal(len(tokens)))
        cache.reserve(len(tokens))
        model(*step, reference)
        model(*step, cache)
        reference.commit(torch.arange(len(tokens)))
        cache.commit(torch.arange(len(tokens)))
    trees = [random_tree(n, rng) for n in (0, 9, 30)]
    expected = []
    for tree, reference, cache in zip(trees, alone, mixed):
        reference.reserve(len(tree[0]))
        cache.reserve(len(tree[0]))
        expected.append(model(*tree, reference))
    assert StepPlan.build([StepInput(*tree, cache) for tree, cache in zip(trees, mixed)]).pool is None
    outputs = model.forward_batch([StepInput(*tree, cache) for tree, cache in zip(trees, mixed)])
    for i, (got, want) in enumerate(zip(outputs, expected)):
        assert torch.equal(got, want), f"session {i} differs when mixed"


def test_one_pool_store_per_layer_for_pooled_sessions(checkpoint, model):
    pool = KVPool(checkpoint.args, 1024, 16)
    caches = [pool.session() for _ in range(3)]
    for cache, count in zip(caches, (5, 1, 17)):
        cache.reserve(count)
    plan = StepPlan.build([StepInput(torch.zeros(n, dtype=torch.int64), torch.arange(n), causal(n), cache)
                           for cache, n in zip(caches, (5, 1, 17))])
    assert plan.pool is pool
    assert torch.equal(plan.pool_slots, torch.cat([cache.step_slots for cache in caches]))


def test_step_cost_benchmark_reports_every_configuration(model):
    costs = step_costs(model, context=24, trees=[1, 4], batches=[1, 2], repeats=1)
    assert set(costs) == {(1, 1), (4, 1), (1, 2), (16, 1), (16, 2)}
    assert all(ms > 0 for ms in costs.values())
