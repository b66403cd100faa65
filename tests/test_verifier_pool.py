"""The bounded KV pool: explicit capacity, RESOURCE_EXHAUSTED instead of a crash, memory back on
release and on idle expiry, and paged caches that compute exactly what a contiguous cache does."""

import os
import time

import grpc
import pytest
import torch

from pardec.runtime.errors import ConfigError, NotFound, ResourceExhausted
from pardec.runtime.serving import start_server
from pardec.v1 import verifier_pb2, verifier_pb2_grpc
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.service import VerifierServicer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

SMALL = dict(max_seq_len=256, max_input_tokens=128, kv_pool_tokens=320, kv_block_tokens=32, measure_cost_curve=False)


def engine_with(model, checkpoint, **overrides) -> Engine:
    return Engine(model, checkpoint.tokenizer, checkpoint.model_name, VerifierConfig(**{**SMALL, **overrides}))


def prompt(count: int, offset: int = 0) -> list[int]:
    return [(1000 + 7 * i + offset) % 49152 for i in range(count)]


def test_a_full_pool_refuses_new_work_and_recovers_on_release(model, checkpoint):
    engine = engine_with(model, checkpoint)
    pool = engine.pool
    assert pool.capacity_tokens == 320
    try:
        engine.prefill("a", prompt(100), Sampling(), None)  # 4 blocks
        engine.prefill("b", prompt(100, 1), Sampling(), None)  # 4 more: 2 of 10 left
        with pytest.raises(ResourceExhausted, match="kv_pool_tokens"):
            engine.prefill("c", prompt(100, 2), Sampling(), None)
        # A tree that needs more than what is left is refused; the session goes on unharmed.
        with pytest.raises(ResourceExhausted, match="kv pool"):
            engine.verify("a", prompt(120, 3), [-1] + list(range(119)))
        tokens = [engine.verify("a", [], []).bonus_token for _ in range(3)]
        assert engine.release("b") and not engine.release("b")
        engine.prefill("c", prompt(100, 2), Sampling(), None)
        for session in ("a", "c"):
            engine.release(session)
        assert pool.free_tokens == pool.capacity_tokens
        # The refused tree did not disturb "a": a fresh run gives the same tokens.
        engine.prefill("a", prompt(100), Sampling(), None)
        assert [engine.verify("a", [], []).bonus_token for _ in range(3)] == tokens
        engine.release("a")
    finally:
        engine.close()


def test_idle_sessions_expire_without_new_work(model, checkpoint):
    engine = engine_with(model, checkpoint, session_idle_s=0.3)
    try:
        engine.prefill("idle", prompt(40), Sampling(), None)
        assert engine.pool.free_tokens < engine.pool.capacity_tokens
        deadline = time.monotonic() + 5
        while engine.sessions and time.monotonic() < deadline:
            time.sleep(0.05)  # no calls: the engine's own clock must expire it
        assert engine.sessions == 0 and engine.pool.free_tokens == engine.pool.capacity_tokens
        with pytest.raises(NotFound, match="expired"):
            engine.verify("idle", [], [])
    finally:
        engine.close()


def test_servicer_maps_a_full_pool_to_resource_exhausted(model, checkpoint):
    engine = engine_with(model, checkpoint)
    server, address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            for index in range(2):
                stub.Prefill(verifier_pb2.PrefillRequest(session_id=f"s{index}", token_ids=prompt(100, index)))
            with pytest.raises(grpc.RpcError) as error:
                stub.Prefill(verifier_pb2.PrefillRequest(session_id="s2", token_ids=prompt(100, 2)))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "kv_pool_tokens" in error.value.details()
            assert stub.GetModelInfo(verifier_pb2.GetModelInfoRequest()).cost_curve == []
    finally:
        server.stop(None)
        engine.close()


def test_pool_config_is_validated():
    with pytest.raises(ConfigError, match="kv_pool_tokens"):
        VerifierConfig(max_seq_len=4096, max_input_tokens=2048, kv_pool_tokens=4096)
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        VerifierConfig(max_batch_tokens=0)
    with pytest.raises(ConfigError, match="batch_wait_ms"):
        VerifierConfig(batch_wait_ms=-1)
    with pytest.raises(ConfigError, match="batch_wait_share"):
        VerifierConfig(batch_wait_share=1.5)
    with pytest.raises(ConfigError, match="attention: 'fp16' is not one of"):
        VerifierConfig(attention="fp16")
    with pytest.raises(ConfigError, match="session_idle_s must be > 0"):  # NaN is no time: sessions never expired
        VerifierConfig(session_idle_s=float("nan"))


def test_paged_cache_matches_a_contiguous_cache_through_commits(model, checkpoint):
    """Prefill, then steps with partial acceptance, in a contiguous cache and in pool blocks that
    are deliberately not adjacent (the gather path): every logit bit-identical."""
    args = checkpoint.args
    pool = KVPool(args, 1024, 8)
    pool._free -= set(range(0, pool.n_blocks, 2))  # every other block taken: no two free blocks adjacent
    paged, contiguous = pool.session(), KVCache(args, 4)
    tokens = checkpoint.tokenizer.encode_chat("Count the blocks.")
    count = len(tokens)
    steps = [(tokens, torch.arange(count), torch.ones(count, count, dtype=torch.bool).tril(), list(range(count)))]
    # Root, two children of the root, a grandchild under the second: keep root -> second -> grandchild.
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    steps += [([5 + i, 6 + i, 7 + i, 8 + i], torch.tensor([0, 1, 1, 2]), tree, [0, 2, 3]) for i in range(6)]
    for step_tokens, depths, ancestors, keep in steps:
        logits = []
        for cache in (paged, contiguous):
            cache.reserve(len(step_tokens))
            logits.append(model(torch.tensor(step_tokens), depths, ancestors, cache))
            cache.commit(torch.tensor(keep))
        assert torch.equal(*logits)
    assert paged._run_start is None and paged.length == contiguous.length
    paged.free()
    assert pool.free_tokens == pool.capacity_tokens // 2


def test_sessions_stay_adjacent_by_growing_in_place_or_moving(model, checkpoint):
    """Two sessions prefilled back to back, then grown in turns: each stays one adjacent run
    (read as a slice), and a session that must move keeps its logits bit-identical."""
    args = checkpoint.args
    pool = KVPool(args, 64 * 4, 4)
    first, second = pool.session(), pool.session()
    reference = KVCache(args, 4)
    tokens = checkpoint.tokenizer.encode_chat("Grow in place.")
    count = len(tokens)
    chain = torch.ones(count, count, dtype=torch.bool).tril()
    for cache in (first, second, reference):
        cache.reserve(count)
        model(torch.tensor(tokens), torch.arange(count), chain, cache)
        cache.commit(torch.arange(count))
    # Crowd the space after `first`, so that its growth has to move it.
    blocker = pool.allocate(1, "a test", after=first.blocks[-1])
    assert blocker == [first.blocks[-1] + 1]
    start = first.blocks[0]
    for step in range(10):
        for cache in (first, second, reference):
            cache.reserve(1)
            logits = model(torch.tensor([100 + step]), torch.zeros(1, dtype=torch.int64),
                           torch.ones(1, 1, dtype=torch.bool), cache)
            cache.commit(torch.tensor([0]))
            if cache is first:
                first_logits = logits
            elif cache is reference:
                assert torch.equal(first_logits, logits)
        assert first._run_start is not None and second._run_start is not None
    assert first.blocks[0] != start and blocker[0] not in first.blocks  # it moved


def test_a_session_sharing_a_later_prefix_block_is_not_moved_past_its_promise(checkpoint):
    """B's first block is its own (it asked prompt_logprobs, so it matched nothing), its second
    is indexed and C holds it too. Growing past a neighbour, B must not move: the shared block
    would stay taken beside the new run, one block beyond what admission promised, and every
    promised session (B, D) would be refused inside its promise."""
    block = 4
    pool = KVPool(checkpoint.args, 24 * block, block)

    def opened(tokens: list[int], promise_tokens: int, match: bool = True):
        cache = pool.session()  # as the engine's admission and prefill do
        cache.promise(promise_tokens, "a test")
        matched = pool.prefixes.match(tokens, (len(tokens) - 1) // block) if match else []
        if matched:
            cache.adopt(matched, "a test")
        cache.reserve(len(tokens) - cache.length)
        cache.begin_step(len(tokens) - cache.length)
        cache.commit(torch.arange(cache.step_size), trim=False)
        pool.prefixes.remember(cache.blocks, tokens)
        return cache

    system = [1, 2, 3, 4]
    opened([*system, 9], 40)  # A: the system prompt's block indexed
    second = opened([*system, 5, 6, 7, 8, 9], 24, match=False)
    third = opened([*system, 5, 6, 7, 8, 9], 24)
    assert third.blocks[1] == second.blocks[1] and third.blocks[0] != second.blocks[0]
    pool.allocate(1, "a neighbour", after=second.blocks[-1])
    last = pool.session()
    last.promise(pool.unpromised_blocks * block, "a test")
    while len(second.blocks) < second.promised:  # B decodes inside its promise
        second.reserve(1)
        second.begin_step(1)
        second.commit(torch.tensor([0]))
    assert pool.unpromised_blocks == 0
    last.reserve(last.promised * block, "a test")  # D grows into all it was promised


def test_a_move_that_finds_no_adjacent_run_leaves_cached_prefixes_cached(checkpoint):
    """A session that cannot grow in place looks for one adjacent run to move to; where the free
    blocks are scattered it takes none, so an idle cached prefix among them stays findable."""
    block = 4
    pool = KVPool(checkpoint.args, 8 * block, block)
    every = pool.allocate(8, "a test")
    prompt = [5, 6, 7, 8]
    pool.prefixes.remember([3], prompt)
    pool.release([1, 3, 5, 7])  # scattered free blocks, 3 an idle cached prefix among them
    assert pool.prefixes.match([*prompt, 9], 1) == [3]
    assert pool.allocate(2, "a test", covered=2, adjacent_only=True) == []
    assert pool.prefixes.match([*prompt, 9], 1) == [3] and pool.free_tokens == 4 * block
    assert sorted(pool.allocate(4, "a test", covered=4)) == [1, 3, 5, 7] and every
