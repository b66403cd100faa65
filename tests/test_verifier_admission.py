"""Capacity and failure isolation in the verifier, through the real engine and model.

A session admitted with its max_new_tokens is promised every KV block it may use, so under a
small pool every request either completes (exactly its plain tokens) or is refused before any
token; a failed prefill gives its blocks back; a forward that fails for one item fails only it.
"""

import dataclasses
import os
import random
import threading

import grpc
import pytest
import torch

from pardec.runtime.errors import ResourceExhausted
from pardec.runtime.serving import start_server
from pardec.v1 import verifier_pb2, verifier_pb2_grpc
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.acceptance import tree_layout
from pardec.verifier.engine.batching import VerifyWork
from pardec.verifier.engine.engine import Engine
from pardec.verifier.service import VerifierServicer
from tests.prompts import CHAT_PROMPTS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

# 6 blocks of 32 positions; a session of a 40-token prompt, 24 new tokens and an 8-node tree may
# use 3 of them, so 2 such sessions fit at once (admitted with room for their prompts only, 3
# would, and then run out mid-way).
SMALL = dict(max_seq_len=128, max_input_tokens=64, kv_pool_tokens=192, kv_block_tokens=32, max_tree_nodes=8,
             measure_cost_curve=False)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(checkpoint):
    encoded = [checkpoint.tokenizer.encode_chat(p) for p in CHAT_PROMPTS]
    assert all(len(p) <= 40 for p in encoded)
    return encoded


def engine_with(model, checkpoint, **overrides) -> Engine:
    return Engine(model, checkpoint.tokenizer, checkpoint.model_name, VerifierConfig(**{**SMALL, **overrides}))


def random_tree(rng: random.Random, nodes: int) -> tuple[list[int], list[int]]:
    """A tree the model mostly rejects: each step then grows the cache by its whole tree first."""
    size = rng.randrange(0, nodes + 1)
    return [rng.randrange(3, 49152) for _ in range(size)], [rng.randrange(-1, i) for i in range(size)]


def generate(engine, session_id, prompt, seed, trees=True) -> list[int]:
    """Greedy decoding of NEW_TOKENS, stepping while fewer are generated, as the gateway does."""
    rng = random.Random(seed)
    first = engine.prefill(session_id, prompt, Sampling(), None, max_new_tokens=NEW_TOKENS).token
    generated = [first]
    while len(generated) < NEW_TOKENS:
        tokens, parents = random_tree(rng, engine.config.max_tree_nodes) if trees else ([], [])
        result = engine.verify(session_id, tokens, parents)
        generated += [*result.accepted_tokens, result.bonus_token]
    engine.release(session_id)
    return generated[:NEW_TOKENS]


def run_concurrently(engine, prompts, count) -> dict[int, object]:
    """Each request's tokens, or the error that ended it and whether that came before any token."""
    outcomes: dict[int, object] = {}

    def run(i):
        prompt = prompts[i % len(prompts)]
        try:
            outcomes[i] = generate(engine, f"r{i}", prompt, seed=i)
        except ResourceExhausted as error:
            outcomes[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


@pytest.fixture(scope="module")
def plain(model, checkpoint, prompts):
    """Each prompt's greedy tokens, decoded alone without trees."""
    engine = engine_with(model, checkpoint)
    try:
        return [generate(engine, f"plain{i}", p, seed=0, trees=False) for i, p in enumerate(prompts)]
    finally:
        engine.close()


def test_under_a_small_pool_each_request_completes_or_is_refused_up_front(model, checkpoint, prompts, plain):
    engine = engine_with(model, checkpoint)
    refused_at_prefill = []
    original = engine.prefill

    def prefill(*args, **kwargs):  # records who was refused by prefill, i.e. before any token
        try:
            return original(*args, **kwargs)
        except ResourceExhausted:
            refused_at_prefill.append(args[0])
            raise

    engine.prefill = prefill
    try:
        outcomes = run_concurrently(engine, prompts, 4)
        completed = [i for i, o in outcomes.items() if isinstance(o, list)]
        failed = {f"r{i}": o for i, o in outcomes.items() if not isinstance(o, list)}
        assert set(failed) == set(refused_at_prefill), f"failed mid-way: {failed}"
        assert completed and failed, (completed, failed)
        for i in completed:
            assert outcomes[i] == plain[i % len(prompts)], f"request {i} differs from plain decoding"
        for error in failed.values():
            assert "kv_pool_tokens" in str(error) and "max_new_tokens" in str(error)
        assert engine.pool.free_tokens == engine.pool.capacity_tokens
        assert engine.pool.unpromised_blocks == engine.pool.n_blocks
    finally:
        engine.close()


def test_with_an_admission_wait_every_request_completes(model, checkpoint, prompts, plain):
    engine = engine_with(model, checkpoint, admission_wait_s=600.0)
    try:
        outcomes = run_concurrently(engine, prompts, 4)
        for i, outcome in outcomes.items():
            assert outcome == plain[i % len(prompts)], f"request {i}: {outcome}"
        assert engine.pool.unpromised_blocks == engine.pool.n_blocks
    finally:
        engine.close()


def test_a_wait_that_runs_out_is_resource_exhausted_and_takes_nothing(model, checkpoint, prompts):
    engine = engine_with(model, checkpoint, admission_wait_s=0.3)
    try:
        for i in range(2):
            engine.prefill(f"hold{i}", prompts[0], Sampling(), None, max_new_tokens=NEW_TOKENS)
        with pytest.raises(ResourceExhausted, match="admission_wait_s"):
            engine.prefill("late", prompts[0], Sampling(), None, max_new_tokens=NEW_TOKENS)
        assert engine.sessions == 2
        for i in range(2):
            engine.release(f"hold{i}")
        engine.prefill("late", prompts[0], Sampling(), None, max_new_tokens=NEW_TOKENS)
        engine.release("late")
        assert engine.pool.unpromised_blocks == engine.pool.n_blocks
    finally:
        engine.close()


def test_the_session_limit_is_resource_exhausted_naming_it(model, checkpoint, prompts):
    engine = engine_with(model, checkpoint, max_sessions=2)
    try:
        engine.prefill("a", prompts[0], Sampling(), None)
        engine.prefill("b", prompts[1], Sampling(), None)
        with pytest.raises(ResourceExhausted, match="max_sessions"):
            engine.prefill("c", prompts[0], Sampling(), None)
    finally:
        engine.close()


def test_the_servicer_refuses_what_the_pool_cannot_promise(model, checkpoint, prompts):
    engine = engine_with(model, checkpoint)
    server, address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            request = verifier_pb2.PrefillRequest(session_id="long0", token_ids=prompts[0], max_new_tokens=200)
            stub.Prefill(request)  # promised max_seq_len: 4 of 6 blocks
            with pytest.raises(grpc.RpcError) as error:
                stub.Prefill(verifier_pb2.PrefillRequest(session_id="long1", token_ids=prompts[1], max_new_tokens=200))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_new_tokens 200" in error.value.details() and "kv_pool_tokens" in error.value.details()
            stub.Release(verifier_pb2.ReleaseRequest(session_id="long0"))
            stub.Prefill(verifier_pb2.PrefillRequest(session_id="long1", token_ids=prompts[1], max_new_tokens=200))
    finally:
        server.stop(None)
        engine.close()


def test_a_prefill_that_fails_gives_its_blocks_back(model, checkpoint, prompts):
    engine = engine_with(model, checkpoint)
    try:
        free, unpromised = engine.pool.free_tokens, engine.pool.unpromised_blocks
        # A temperature so small that the scaled logits overflow: the first token's draw fails
        # after the prompt went through the model. Sampling refuses it at the API (it must be 0
        # or at least MIN_TEMPERATURE), so it is set past that check to reach a failure inside.
        tiny = Sampling(temperature=1.0)
        object.__setattr__(tiny, "temperature", 5e-324)
        for max_new_tokens in (0, NEW_TOKENS):
            with pytest.raises(RuntimeError, match="probability"):
                engine.prefill("bad", prompts[0], tiny, 1, max_new_tokens=max_new_tokens)
            assert engine.sessions == 0
            assert (engine.pool.free_tokens, engine.pool.unpromised_blocks) == (free, unpromised)
    finally:
        engine.close()


def test_a_failed_item_of_a_batched_forward_fails_alone(model, checkpoint, prompts):
    engine = engine_with(model, checkpoint, kv_pool_tokens=512)  # four sessions at once
    tree = ([prompts[0][5], prompts[0][6]], [-1, 0])
    try:
        engine.prefill("alone", prompts[0], Sampling(), None)
        expected = engine.verify("alone", *tree)
        engine.prefill("good", prompts[0], Sampling(), None)
        engine.prefill("bad", prompts[1], Sampling(), None)

        def batch_good_with_bad():
            works = [VerifyWork(s, tree[0], tree_layout(0, *tree, engine.vocab_size)) for s in ("good", "bad")]
            items = [engine._verify_input(work) for work in works]
            # A token past the vocabulary, as a corrupted input that got past the checks would be.
            items[1] = dataclasses.replace(items[1], tokens=torch.full_like(items[1].tokens, engine.vocab_size))
            forwards = engine.stats.forwards
            engine._forward(list(zip(works, items)))
            assert engine.stats.forwards == forwards + 1
            return works

        good, bad = engine.call(batch_good_with_bad)
        result = good.future.result(timeout=0)
        assert (result.accepted_tokens, result.bonus_token, result.node_argmax) == (
            expected.accepted_tokens, expected.bonus_token, expected.node_argmax)
        with pytest.raises(IndexError):
            bad.future.result(timeout=0)
        # The bad item's session committed nothing and goes on as if the step had not been.
        engine.prefill("bad-alone", prompts[1], Sampling(), None)
        assert engine.verify("bad", [], []).bonus_token == engine.verify("bad-alone", [], []).bonus_token
    finally:
        engine.close()
