"""Where the KV pool places sessions: packed down from the pool's top, each below the room its
upper neighbour may still grow into, so that under endless churn the blocks ever written (the
pages the OS commits) stay within what the sessions held at most at once."""

import doctest
import random

from pardec.verifier.model import kv_placement
from pardec.verifier.model.args import ModelArgs
from pardec.verifier.model.kvcache import KVPool

# Blocks of one token and one number each: placement is all that is under test here.
TINY = ModelArgs(architecture="llama", vocab_size=8, dim=2, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=2,
                 rope_theta=10000.0, norm_eps=1e-5, max_position=4096, tie_embeddings=True, qkv_bias=False)


def test_the_docstring_examples():
    assert doctest.testmod(kv_placement).failed == 0


def test_the_worked_example_through_the_pool():
    pool = KVPool(TINY, 10, 1)
    first, second = pool.session(), pool.session()
    first.promise(4, "a test")
    first.reserve(2)
    assert first.blocks == [6, 7]
    second.promise(3, "a test")
    second.reserve(3)
    assert second.blocks == [3, 4, 5]  # below the room [8, 10) the first may grow into
    first.length = 2
    first.reserve(2)
    assert first.blocks == [6, 7, 8, 9] and first._run_start == 6


def test_a_session_without_a_promise_leaves_room_for_as_much_again():
    pool = KVPool(TINY, 16, 1)
    first, second = pool.session(), pool.session()
    first.reserve(3)
    second.reserve(2)
    assert first.blocks == [10, 11, 12] and second.blocks == [6, 7]


def test_churn_stays_within_the_most_held_at_once():
    """Thousands of sessions of random prompts and lengths come and go, at most 12 at a time, each
    promised what it may use and growing a block at a time: the lowest block ever handed out stays
    within half as much again as the most blocks ever promised at once, and nearly every session
    stays one adjacent run."""
    rng = random.Random(33)
    pool = KVPool(TINY, 4096, 1)
    live: list = []
    lowest = pool.n_blocks
    most_promised = 0
    gathered_steps = steps = 0
    for _ in range(4000):
        if len(live) < 12 and (not live or rng.random() < 0.5):
            session = pool.session()
            prompt, new = rng.randint(4, 60), rng.randint(8, 40)
            session.promise(prompt + new, "a test")
            session.reserve(prompt)
            session.length = prompt
            live.append([session, new])
        for entry in list(live):
            session, left = entry
            session.reserve(1)
            session.length += 1
            steps += 1
            gathered_steps += session._run_start is None
            entry[1] -= 1
            if entry[1] == 0 or rng.random() < 0.02:  # finished, or cancelled
                session.free()
                live.remove(entry)
        lowest = min([lowest] + [min(s.blocks) for s, _ in live if s.blocks])
        most_promised = max(most_promised, sum(s.promised for s, _ in live))
    touched = pool.n_blocks - lowest
    # Placing each session in the middle of the largest free run touched 3,935 of the 4,096.
    assert touched <= 1.5 * most_promised, (touched, most_promised)
    assert pool.touched_blocks == touched and pool.touched_bytes == touched * 16  # keys and values of 2 fp32 numbers
    assert gathered_steps <= steps // 100, (gathered_steps, steps)
