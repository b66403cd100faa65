"""Prefix caching: a prompt that starts as an earlier one did holds that one's KV blocks instead
of computing them, and every token it then generates is the one it would have without them."""

import doctest
import threading
import uuid

import grpc
import pytest
import torch

from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import serve as serve_gateway
from pardec.runtime.errors import ResourceExhausted
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model import prefix_cache
from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.model.prefix_cache import PrefixIndex
from pardec.verifier.service import VerifierServicer
from tests.openai_front import model_of

torch.set_num_threads(2)

SMALL = dict(max_seq_len=512, max_input_tokens=384, kv_pool_tokens=1024, kv_block_tokens=32,
             measure_cost_curve=False)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return checkpoint.tokenizer


def engine_with(model, checkpoint, **overrides) -> Engine:
    return Engine(model, checkpoint.tokenizer, checkpoint.model_name, VerifierConfig(**{**SMALL, **overrides}))


@pytest.fixture
def engines(model, checkpoint):
    """Two engines on the same model, prefix caching on and off."""
    cached, plain = engine_with(model, checkpoint), engine_with(model, checkpoint, prefix_caching=False)
    yield cached, plain
    cached.close()
    plain.close()


def system_prompt(tokenizer, question: str) -> list[int]:
    system = ("You are a careful assistant for a hardware shop. Answer in one short sentence, name the "
              "part and its price, and never invent a part the shop does not sell. ") * 3
    return tokenizer.encode(system + "\nQuestion: " + question + "\nAnswer:")


def generate(engine: Engine, session: str, prompt: list[int], new_tokens: int, tree: bool = False,
             sampling: Sampling = Sampling(), seed: int | None = None) -> list[int]:
    """Greedy (or seeded) decoding; with `tree`, each step also verifies a small chain drafted
    from the prompt, so that steps accept nodes and commit rows past the cached prefix."""
    first = engine.prefill(session, prompt, sampling, seed).token
    out = [first]
    while len(out) < new_tokens:
        draft = prompt[len(out) % 7 : len(out) % 7 + 3] if tree else []
        result = engine.verify(session, draft, list(range(-1, len(draft) - 1)))
        out += [*result.accepted_tokens, result.bonus_token]
    return out[:new_tokens]


def test_the_worked_example():
    assert doctest.testmod(prefix_cache).failed == 0


def test_a_shared_system_prompt_is_computed_once_and_changes_no_token(engines, tokenizer):
    cached, plain = engines
    for question in ("How much is a 2 TB disk?", "Do you sell USB cables?", "What fan fits a 1U case?"):
        prompt = system_prompt(tokenizer, question)
        assert generate(cached, question, prompt, 24, tree=True) == generate(plain, question, prompt, 24, tree=True)
        assert cached.release(question) and plain.release(question)
    stats = cached.stats
    shared = len(system_prompt(tokenizer, "")) // 32 * 32  # the full blocks the questions share
    assert shared >= 64
    # The first prompt computed everything; each later one only what follows the shared blocks.
    assert stats.cached_prompt_tokens >= 2 * (shared - 32)
    assert plain.stats.cached_prompt_tokens == 0 and plain.stats.prompt_tokens == stats.prompt_tokens
    assert stats.rows < plain.stats.rows - stats.cached_prompt_tokens + 1
    # Every block went back: idle prefixes are free blocks.
    assert cached.pool.free_tokens == cached.pool.capacity_tokens


def test_the_next_turn_of_a_conversation_finds_the_previous_answer(engines, tokenizer):
    cached, plain = engines
    first_turn = system_prompt(tokenizer, "How much is a 2 TB disk?")
    answer = generate(cached, "turn-1", first_turn, 40, tree=True)
    assert answer == generate(plain, "turn-1", first_turn, 40, tree=True)
    cached.release("turn-1")
    plain.release("turn-1")
    second_turn = first_turn + answer + tokenizer.encode("\nQuestion: And a 4 TB one?\nAnswer:")
    before = cached.stats.cached_prompt_tokens
    assert generate(cached, "turn-2", second_turn, 24) == generate(plain, "turn-2", second_turn, 24)
    # The cache holds the first turn's prompt and its answer, up to the last full block before
    # the last answer token (that one was the root, never cached).
    reached = (len(first_turn) + len(answer) - 1) // 32 * 32
    assert cached.stats.cached_prompt_tokens - before == reached


def test_sessions_holding_the_same_blocks_at_once_each_get_their_own_tokens(engines, tokenizer):
    cached, plain = engines
    prompts = {name: system_prompt(tokenizer, name) for name in ("Do you sell RAM?", "Any SSD on sale?")}
    seeded = Sampling(temperature=0.8, top_p=0.9)
    for engine in (cached, plain):
        for name, prompt in prompts.items():
            engine.prefill(name, prompt, seeded, 7)
    first = list(prompts)[0]
    shared = cached._sessions[first].cache.blocks[:2]
    assert all(block in cached.pool.prefixes for block in shared)
    assert cached._sessions[list(prompts)[1]].cache.blocks[:2] == shared  # the same blocks, held twice
    for step in range(12):
        for name in prompts:
            a, b = cached.verify(name, [], []), plain.verify(name, [], [])
            assert (a.accepted_tokens, a.bonus_token) == (b.accepted_tokens, b.bonus_token), (name, step)
    cached.release(first)
    assert all(block not in cached.pool._free for block in shared)  # the other session holds them still
    cached.release(list(prompts)[1])
    assert all(block in cached.pool._free for block in shared)


def test_a_prompt_still_being_prefilled_lends_the_blocks_it_has_written(model, checkpoint, tokenizer):
    """A long prompt's blocks are findable chunk by chunk, before its prefill ends: the same
    prompt admitted meanwhile computes only the rest, and both generate plain decoding's tokens."""
    engine = engine_with(model, checkpoint, max_batch_tokens=32)  # a chunk of 32 positions a forward
    plain = engine_with(model, checkpoint, prefix_caching=False)
    prompt = tokenizer.encode("Parts list: " + ", ".join(f"part {n} costs {n * 3 % 17} euros" for n in range(60)))
    prompt = prompt[:320]
    assert len(prompt) == 320
    try:
        expected = generate(plain, "alone", prompt, 12)
        first: dict = {}
        worker = threading.Thread(target=lambda: first.setdefault("tokens", generate(engine, "first", prompt, 12)))
        worker.start()
        seen = None
        while seen is None and worker.is_alive():
            # Between two forwards: how far the first prompt is, and what the index finds of it.
            progress = engine.call(lambda: [(w.done, len(engine.pool.prefixes.match(prompt, 9, "")))
                                            for w in engine._prefilling if w.session_id == "first"])
            if progress and progress[0][0] >= 64:
                seen = progress[0]
        assert seen is not None, "the first prefill ended before its second chunk was seen"
        done, findable = seen
        assert findable == done // 32 and done < len(prompt)
        assert generate(engine, "second", prompt, 12) == expected
        assert engine.stats.cached_prompt_tokens >= done  # the second's; the first found nothing
        worker.join()
        assert first["tokens"] == expected
    finally:
        engine.close()
        plain.close()


def test_a_prefix_is_found_only_in_its_own_scope(model, checkpoint, tokenizer):
    engine = engine_with(model, checkpoint)
    try:
        prompt = system_prompt(tokenizer, "Is this shop open on Sundays?")
        first = engine.prefill("a-1", prompt, Sampling(), None, cache_scope="tenant-a")
        engine.release("a-1")
        other = engine.prefill("b-1", prompt, Sampling(), None, cache_scope="tenant-b")
        unscoped = engine.prefill("anonymous", prompt, Sampling(), None)
        again = engine.prefill("a-2", prompt, Sampling(), None, cache_scope="tenant-a")
        assert first.cached_tokens == other.cached_tokens == unscoped.cached_tokens == 0
        assert again.cached_tokens == (len(prompt) - 1) // 32 * 32
        assert first.token == other.token == unscoped.token == again.token
    finally:
        engine.close()


def test_a_scope_too_long_is_refused_naming_the_field(stack):
    request = verifier_pb2.PrefillRequest(session_id="scoped", token_ids=[1, 2, 3], cache_scope="x" * 257)
    with pytest.raises(grpc.RpcError) as refused:
        stack.verifier.Prefill(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_scope: must be at most 256 characters" in refused.value.details()


def test_idle_prefixes_give_way_to_new_work_oldest_first(model, checkpoint, tokenizer):
    engine = engine_with(model, checkpoint, kv_pool_tokens=640, max_seq_len=320, max_input_tokens=256)
    try:
        old = system_prompt(tokenizer, "an old question")
        new = system_prompt(tokenizer, "a newer question")
        expected = generate(engine, "old", old, 4)
        engine.release("old")
        generate(engine, "new", new, 4)
        engine.release("new")
        pool = engine.pool
        assert pool.prefixes.idle_count > 0 and pool.free_tokens == pool.capacity_tokens
        # Prompts of other text take every free block: the idle prefixes are taken back as needed.
        others = [[(1000 + 13 * i + k) % 49152 for i in range(250)] for k in range(2)]
        for k, prompt in enumerate(others):
            engine.prefill(f"other-{k}", prompt, Sampling(), None)
        assert pool.prefixes.idle_count < 10
        for k in range(2):
            engine.release(f"other-{k}")
        assert generate(engine, "old-again", old, 4) == expected
    finally:
        engine.close()


def test_an_idle_prefix_is_not_taken_from_a_neighbours_promise(model, checkpoint):
    pool = KVPool(model.args, capacity_tokens=4 * 32, block_tokens=32)
    tokens = list(range(100, 164))
    first = pool.session()
    first.reserve(64)
    pool.prefixes.remember(first.blocks, tokens)
    first.free()
    assert pool.prefixes.idle_count == 2 and pool.unpromised_blocks == 4
    neighbour = pool.session()
    neighbour.promise(4 * 32, why="a neighbour")
    newcomer = pool.session()
    with pytest.raises(ResourceExhausted, match="cached prefix"):
        newcomer.adopt(pool.prefixes.match(tokens + [1], limit=2), why="a newcomer")
    assert newcomer.blocks == [] and pool.prefixes.idle_count == 2  # nothing changed
    neighbour.free()
    newcomer.adopt(pool.prefixes.match(tokens + [1], limit=2), why="a newcomer")
    assert newcomer.length == 64 and pool.prefixes.idle_count == 0


def test_a_released_prefix_is_taken_back_from_its_end(model):
    pool = KVPool(model.args, capacity_tokens=4 * 32, block_tokens=32)
    tokens = list(range(100, 196))
    first = pool.session()
    first.reserve(96)
    chain = list(first.blocks)
    pool.prefixes.remember(chain, tokens)
    first.free()
    assert pool.prefixes.idle_blocks() == chain[::-1]
    # One block was never cached: a session of two takes it and the chain's last block.
    pool.session().reserve(64)
    assert pool.prefixes.match(tokens + [1], limit=3) == chain[:2]


def test_the_index_keys_each_block_by_every_token_before_it():
    index = PrefixIndex(block_tokens=2)
    index.remember([0, 1], [1, 2, 3, 4])
    assert index.match([1, 2, 3, 4], limit=2) == [0, 1]
    assert index.match([9, 2, 3, 4], limit=2) == []  # the same second block after another first
    index.remember([5, 6], [1, 2, 3, 4])  # a second copy of the same prefix stays private
    assert 5 not in index and index.match([1, 2, 3, 4], limit=2) == [0, 1]


def test_clients_see_how_much_of_the_prompt_was_cached_and_the_same_text(stack, front, client):
    """gRPC's DecodingStats.cached_prompt_tokens and HTTP's usage.prompt_tokens_details.cached_tokens,
    on a prompt no other test sends (its first request finds nothing cached)."""
    system = f"Conversation {uuid.uuid4().hex}. " + "Answer briefly and politely, in plain words. " * 12
    messages = [gateway_pb2.Message(role=gateway_pb2.ROLE_SYSTEM, content=system),
                gateway_pb2.Message(role=gateway_pb2.ROLE_USER, content="Name a prime number.")]
    request = gateway_pb2.GenerateRequest(messages=messages, max_new_tokens=12)
    first, again = stack.gateway.Generate(request, timeout=300), stack.gateway.Generate(request, timeout=300)
    assert first.stats.cached_prompt_tokens == 0
    assert again.stats.cached_prompt_tokens >= 64 and again.stats.cached_prompt_tokens < again.stats.prompt_tokens
    assert list(again.token_ids) == list(first.token_ids)
    reply = client.chat.completions.create(
        model=model_of(front), max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Name a prime number."}],
    )
    assert reply.usage.prompt_tokens_details.cached_tokens == again.stats.cached_prompt_tokens
    assert reply.choices[0].message.content == first.text


def test_a_conversation_goes_back_to_the_replica_that_holds_its_start(stack, engine, model, checkpoint):
    """Two verifier replicas behind one gateway: a conversation started on the second (the first
    was busy) comes back to it for its next turn and for another question behind the same system
    prompt, where the blocks are, although both replicas are idle by then."""
    other = Engine(model, checkpoint.tokenizer, checkpoint.model_name, VerifierConfig(measure_cost_curve=False))
    servers = [start_server([VerifierServicer(e).add_to], "127.0.0.1:0") for e in (engine, other)]
    gateway, address = serve_gateway(
        GatewayConfig(verifier_target=",".join(a for _, a in servers), drafter_target=stack.addresses["drafter"]),
        "127.0.0.1:0",
    )
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        system = _message(gateway_pb2.ROLE_SYSTEM, f"Shop {uuid.uuid4().hex}. " + "Answer in one short sentence. " * 12)
        question = _message(gateway_pb2.ROLE_USER, "Do you sell fans?")
        # The first replica is busy with another conversation while this one starts.
        busy = stub.GenerateStream(gateway_pb2.GenerateRequest(
            messages=[_message(gateway_pb2.ROLE_USER, f"Count to fifty. {uuid.uuid4().hex}")], max_new_tokens=200,
        ), timeout=300)
        next(busy)
        first_turn = stub.Generate(gateway_pb2.GenerateRequest(messages=[system, question], max_new_tokens=12),
                                   timeout=300)
        busy.cancel()
        assert other.stats.prompt_tokens == first_turn.stats.prompt_tokens  # it went to the idle replica
        next_turn = [system, question, _message(gateway_pb2.ROLE_ASSISTANT, first_turn.text),
                     _message(gateway_pb2.ROLE_USER, "And a quiet one?")]
        for messages in (next_turn, [system, _message(gateway_pb2.ROLE_USER, "Any cables?")]):
            reply = stub.Generate(gateway_pb2.GenerateRequest(messages=messages, max_new_tokens=12), timeout=300)
            assert reply.stats.cached_prompt_tokens >= 64
        assert other.stats.cached_prompt_tokens >= 128
    finally:
        channel.close()
        gateway.stop(None)
        for server, _ in servers:
            server.stop(None)
        other.close()


def _message(role: int, content: str) -> gateway_pb2.Message:
    return gateway_pb2.Message(role=role, content=content)


def test_a_cache_salt_keeps_requests_of_one_tenant_apart(stack, front, client):
    """vLLM's cache_salt, on gRPC and HTTP: only requests with the same salt share blocks."""
    system = f"Desk {uuid.uuid4().hex}. " + "Reply with one polite sentence about the weather. " * 8
    messages = [gateway_pb2.Message(role=gateway_pb2.ROLE_SYSTEM, content=system),
                gateway_pb2.Message(role=gateway_pb2.ROLE_USER, content="Hello!")]

    def cached(salt: str) -> int:
        request = gateway_pb2.GenerateRequest(messages=messages, max_new_tokens=4, cache_salt=salt)
        return stack.gateway.Generate(request, timeout=300).stats.cached_prompt_tokens

    assert cached("alice") == 0 and cached("alice") >= 64
    assert cached("bob") == 0 and cached("") == 0 and cached("") >= 64
    reply = client.chat.completions.create(
        model=model_of(front), max_tokens=4, temperature=0, extra_body={"cache_salt": "alice"},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}],
    )
    assert reply.usage.prompt_tokens_details.cached_tokens >= 64
    with pytest.raises(grpc.RpcError) as refused:
        stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt="Hi", cache_salt="s" * 257), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt: must be a string of at most 256 characters" in refused.value.details()
    import openai

    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(model=model_of(front), max_tokens=4, extra_body={"cache_salt": 7},
                                       messages=[{"role": "user", "content": "Hi"}])


def test_a_block_a_session_fills_is_found_while_the_session_goes_on(engines, tokenizer):
    """A decoding session's blocks are findable as they fill, not only once it closes: a prompt
    of what it wrote so far (beam search's sibling beams) computes only the last partial block,
    and every token stays the one it would be without the cache."""
    cached, plain = engines
    prompt = system_prompt(tokenizer, "How much is a 2 TB disk?")
    answer = generate(cached, "going-on", prompt, 72, tree=True)
    assert answer == generate(plain, "going-on", prompt, 72, tree=True)
    sibling = prompt + answer[:-1]  # the open session's text: its root (the last token) is not cached
    before = cached.stats.cached_prompt_tokens
    assert cached.prefill("sibling", sibling, Sampling(), None).token == plain.prefill("sibling", sibling, Sampling(), None).token
    assert cached.stats.cached_prompt_tokens - before == (len(sibling) - 1) // 32 * 32
    for engine in (cached, plain):
        assert engine.release("going-on") and engine.release("sibling")
    assert cached.pool.free_tokens == cached.pool.capacity_tokens  # every block back, the indexed ones idle
