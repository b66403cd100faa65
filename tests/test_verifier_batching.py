"""Continuous batching across sessions: a session's logits and tokens are bit-identical whether
it is verified alone or packed into one forward with other sessions' steps and prompt chunks."""

import os
import random
import threading

import torch

from pardec.verifier.api import Sampling
from pardec.verifier.model.attention import QUERY_BLOCK
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.model.step import StepInput
from tests.prompts import CHAT_PROMPTS, CODE_PROMPTS, REPETITIVE_PROMPTS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

PROMPTS = [*CODE_PROMPTS, *CHAT_PROMPTS, *REPETITIVE_PROMPTS, "Name a prime.", "Count to ten in French."]


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def random_tree(n_nodes: int, rng: random.Random, vocab: int = 49152):
    """Root plus n_nodes nodes with random parents: (tokens, depths, ancestors)."""
    parents = [-1] + [rng.randrange(0, node) for node in range(1, n_nodes + 1)]
    ancestors = torch.eye(n_nodes + 1, dtype=torch.bool)
    depths = torch.zeros(n_nodes + 1, dtype=torch.int64)
    for node in range(1, n_nodes + 1):
        ancestors[node] |= ancestors[parents[node]]
        depths[node] = depths[parents[node]] + 1
    return torch.tensor([rng.randrange(3, vocab) for _ in parents]), depths, ancestors


def test_batched_forward_is_bit_identical_to_each_session_alone(checkpoint, model):
    rng = random.Random(0)
    prompts = [checkpoint.tokenizer.encode_chat(p) for p in PROMPTS]
    assert len(prompts) == 8
    # Reference: every session alone, in its own contiguous cache. Batched: all in one paged pool,
    # the 8 prompts prefilled together in one forward (so prefill batching is checked too).
    alone = [KVCache(checkpoint.args, len(p) + 2 * QUERY_BLOCK) for p in prompts]
    pool = KVPool(checkpoint.args, 8192, 16)
    paged = [pool.session() for _ in prompts]
    prefills = []
    for tokens, cache, page in zip(prompts, alone, paged):
        count = len(tokens)
        prefills.append(model(torch.tensor(tokens), torch.arange(count), causal(count), cache))
        page.reserve(count)
    batched = model.forward_batch(
        [StepInput(torch.tensor(t), torch.arange(len(t)), causal(len(t)), page) for t, page in zip(prompts, paged)]
    )
    for expected, got in zip(prefills, batched):
        assert torch.equal(expected, got)
    for tokens, cache, page in zip(prompts, alone, paged):
        cache.commit(torch.arange(len(tokens)))
        page.commit(torch.arange(len(tokens)))

    # One step per session: plain (1 token), trees of several sizes, prompt chunks (one longer
    # than an attention query block). Steps are never committed, so each can run many times.
    kinds = [("plain", 1), ("tree", 4), ("tree", 16), ("tree", 40), ("plain", 1), ("tree", 64),
             ("chunk", 24), ("chunk", QUERY_BLOCK + 37)]
    steps, expected = [], []
    for (kind, size), cache, page in zip(kinds, alone, paged):
        if kind == "chunk":
            tokens = torch.tensor([rng.randrange(3, 49152) for _ in range(size)])
            step = (tokens, torch.arange(size), causal(size))
        else:
            step = random_tree(size - 1, rng)
        cache.reserve(len(step[0]))
        page.reserve(len(step[0]))
        expected.append(model(*step, cache))
        steps.append(step)
    for trial in range(8):
        members = rng.sample(range(8), 1 + trial % 8)
        outputs = model.forward_batch([StepInput(*steps[i], paged[i]) for i in members])
        for i, logits in zip(members, outputs):
            assert torch.equal(logits, expected[i]), f"session {i} ({kinds[i]}) differs in a batch of {len(members)}"


def make_engine(model, checkpoint, **overrides) -> Engine:
    config = VerifierConfig(measure_cost_curve=False, **overrides)
    return Engine(model, checkpoint.tokenizer, checkpoint.model_name, config)


def draft(history: list[int], rng: random.Random, style: str) -> tuple[list[int], list[int]]:
    """A cheap stand-in for the drafter: what followed earlier occurrences of the last token,
    as up to two chains under the root, or a random tree, or nothing (plain decoding)."""
    if style == "plain":
        return [], []
    if style == "random":
        size = rng.randrange(1, 12)
        return [rng.randrange(3, 49152) for _ in range(size)], [rng.randrange(-1, i) for i in range(size)]
    tokens, parents = [], []
    starts = [i + 1 for i in range(len(history) - 1) if history[i] == history[-1]][-2:]
    for start in starts:
        chain = history[start : start + 6]
        for depth, token in enumerate(chain):
            parents.append(-1 if depth == 0 else len(tokens) - 1)
            tokens.append(token)
    return tokens, parents


def generate(engine, session_id, prompt, new_tokens, style, seed) -> list[int]:
    rng = random.Random(seed)
    first = engine.prefill(session_id, prompt, Sampling(), None).token
    history, generated = [*prompt, first], [first]
    while len(generated) < new_tokens:
        tokens, parents = draft(history, rng, style)
        result = engine.verify(session_id, tokens, parents)
        step = [*result.accepted_tokens, result.bonus_token]
        history += step
        generated += step
    engine.release(session_id)
    return generated[:new_tokens]


def test_concurrent_greedy_sessions_generate_exactly_their_plain_tokens(checkpoint, model):
    prompts = [checkpoint.tokenizer.encode_chat(p) for p in PROMPTS]
    styles = ["ngram", "plain", "random", "ngram", "ngram", "random", "plain", "ngram"]
    new_tokens = 24
    engine = make_engine(model, checkpoint, batch_wait_ms=20.0)
    try:
        # Alone: one session at a time, plain decoding, one token per forward.
        reference = [generate(engine, f"alone-{i}", p, new_tokens, "plain", i) for i, p in enumerate(prompts)]
        forwards_alone = engine.stats.forwards
        results: dict[int, list[int]] = {}

        def run(i):
            results[i] = generate(engine, f"batched-{i}", prompts[i], new_tokens, styles[i], i)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i in range(8):
            assert results[i] == reference[i], f"session {i} ({styles[i]}) diverged when batched"
        stats = engine.stats
        forwards = stats.forwards - forwards_alone
        steps = stats.verify_steps + stats.prefill_chunks - forwards_alone
        assert steps > 2 * forwards, f"{steps} session steps in {forwards} forwards: barely batched"
        assert engine.pool.free_tokens == engine.pool.capacity_tokens  # every block came back
    finally:
        engine.close()


def test_a_long_prompt_is_chunked_between_other_sessions_steps(checkpoint, model):
    # Without prefix caching: the second prefill of the same prompt must be computed, in chunks.
    engine = make_engine(model, checkpoint, max_batch_tokens=64, batch_wait_ms=0.0, prefix_caching=False)
    try:
        short = checkpoint.tokenizer.encode_chat(PROMPTS[4])
        long = checkpoint.tokenizer.encode_chat(PROMPTS[0] * 3)
        assert len(long) > 4 * 64
        reference = generate(engine, "alone", long, 4, "plain", 0)
        chunks_alone = engine.stats.prefill_chunks
        assert chunks_alone >= 5  # a 64-token budget cuts the prompt
        engine.prefill("decoder", short, Sampling(), None)
        box = {}
        thread = threading.Thread(target=lambda: box.update(tokens=generate(engine, "long", long, 4, "plain", 0)))
        thread.start()
        steps = 0
        while thread.is_alive():
            engine.verify("decoder", [], [])
            steps += 1
        thread.join()
        assert box["tokens"] == reference
        assert steps >= 3  # the decoding session kept stepping while the prompt went in
    finally:
        engine.close()


def _in_order(engine, calls: dict[str, callable]) -> list[str]:
    """The names of ``calls`` in the order they finish, all put on the engine's queue while its
    thread is held, in the order given (so they arrive in that order and are taken together)."""
    held, finished, lock = threading.Event(), [], threading.Lock()
    holder = threading.Thread(target=lambda: engine.call(held.wait))
    holder.start()
    while engine.queue_depth:  # the holder's call is being run: the engine thread is held
        pass
    threads = []
    for name, call in calls.items():
        def run(name=name, call=call):
            call()
            with lock:
                finished.append(name)
        threads.append(threading.Thread(target=run))
        threads[-1].start()
        while engine.queue_depth < len(threads):  # each arrives before the next
            pass
    held.set()
    for thread in [holder, *threads]:
        thread.join()
    return finished


def test_lower_priority_values_go_first_where_the_engine_must_choose(checkpoint, model):
    """vLLM's priority: where a forward cannot take everything queued (here one session a forward,
    a 16-token budget), a lower value's steps and prompt chunks go first, whatever arrived first;
    equal values keep their arrival order. It never changes a token."""
    engine = make_engine(model, checkpoint, max_batch_sessions=1, max_batch_tokens=16, batch_wait_ms=0.0,
                         prefix_caching=False)
    try:
        prompt = checkpoint.tokenizer.encode_chat(PROMPTS[4])
        plain = engine.prefill("plain", prompt, Sampling(), None).token
        for name, priority in (("late", 5), ("urgent", -1), ("same", 5)):
            assert engine.prefill(name, prompt, Sampling(), None, priority=priority).token == plain
        steps = {name: (lambda name=name: engine.verify(name, [], [])) for name in ("late", "same", "urgent")}
        assert _in_order(engine, steps) == ["urgent", "late", "same"]
        long = checkpoint.tokenizer.encode_chat(PROMPTS[0])
        assert len(long) > 3 * 16  # each prompt takes several forwards
        prompts = {name: (lambda name=name, priority=priority: engine.prefill(name, long, Sampling(), None,
                                                                             priority=priority))
                   for name, priority in (("slow", 3), ("fast", 0))}
        assert _in_order(engine, prompts) == ["fast", "slow"]
    finally:
        engine.close()


def test_a_lower_priority_value_is_admitted_first_when_the_pool_frees(checkpoint, model):
    """Prompts waiting for the KV pool's promise (admission_wait_s) are admitted by priority, then
    arrival: a later, more urgent prompt goes ahead of an earlier one."""
    engine = make_engine(model, checkpoint, max_seq_len=256, max_input_tokens=128, kv_pool_tokens=288,
                         kv_block_tokens=32, admission_wait_s=60.0, batch_wait_ms=0.0, prefix_caching=False)
    try:
        prompt = checkpoint.tokenizer.encode_chat(PROMPTS[4])
        engine.prefill("holder", prompt, Sampling(), None, max_new_tokens=200)  # promised 8 of the 9 blocks
        finished, lock, threads = [], threading.Lock(), []
        for name, priority in (("earlier", 5), ("urgent", -1)):
            def wait(name=name, priority=priority):
                engine.prefill(name, prompt, Sampling(), None, max_new_tokens=200, priority=priority)
                with lock:
                    finished.append(name)
                engine.release(name)  # its blocks go back: the other one's turn
            threads.append(threading.Thread(target=wait))
            threads[-1].start()
            while engine.queue_depth < len(threads):  # it waits for the pool before the next arrives
                pass
        engine.release("holder")
        for thread in threads:
            thread.join()
        assert finished == ["urgent", "earlier"]
    finally:
        engine.close()
