"""Trees fit what is left under maxSeqLen by node count, not only by depth (issue 33): a drafter
that answers as wide a tree as the gateway asks for (the real drafter's tree, then extra root
children up to max_nodes) drives a request right up to maxSeqLen. Before, the gateway bounded only
the tree's depth there, and the verifier refused the step (cache + 1 + nodes > max_seq_len) with
RESOURCE_EXHAUSTED, failing a request that plain decoding serves. The counting reply runs past
maxSeqLen 160 after its 50-token prompt, so the request ends exactly at the limit."""

from __future__ import annotations

import pytest

from pardec.gateway.clients import DrafterClient
from pardec.gateway.config import GatewayConfig
from pardec.gateway.generation import Generator, Request
from pardec.gateway.metrics import GatewayMetrics
from pardec.gateway.replicas import VerifierReplicas
from pardec.runtime.serving import start_server
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.engine import Engine
from pardec.verifier.service import VerifierServicer

COUNTING = "Count from 1 to 2000, one number per line, with nothing else."


class WideDrafter:
    """The real drafter client (gRPC to the real drafter), its trees widened to max_nodes."""

    def __init__(self, client):
        self._client, self.widest = client, 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def propose(self, session_id, new_tokens, max_nodes, max_depth, *args, **kwargs):
        tokens, parents, probabilities = self._client.propose(session_id, new_tokens, max_nodes, max_depth, *args, **kwargs)
        pad = max(0, max_nodes - len(tokens))
        tokens = [*tokens, *range(1000, 1000 + pad)]
        parents = [*parents, *([-1] * pad)]
        probabilities = [*probabilities, *([1.0] * pad)]
        self.widest = max(self.widest, len(tokens))
        return tokens, parents, probabilities


@pytest.fixture(scope="module")
def short_verifier(engine):
    config = VerifierConfig(max_seq_len=160, max_input_tokens=128, kv_pool_tokens=1024, measure_cost_curve=False)
    short = Engine(engine.model, engine.tokenizer, engine.model_name, config)
    server, address = start_server([VerifierServicer(short).add_to], "127.0.0.1:0")
    yield short, address
    server.stop(None)
    short.close()


def test_a_wide_tree_near_max_seq_len_is_cut_to_what_is_left(stack, short_verifier):
    short, address = short_verifier
    config = GatewayConfig(verifier_target=address, drafter_target=stack.addresses["drafter"])
    verifier = VerifierReplicas.connect(config.verifier_target, config.rpc_timeout_s)
    drafter = WideDrafter(DrafterClient(config.drafter_target, 10.0, 10.0))
    generator = Generator(config, verifier, drafter, verifier.model_info(60), GatewayMetrics())
    room = 160 - len(short.tokenizer.encode_chat(COUNTING))
    try:
        plain = generator.generate(Request(COUNTING, max_new_tokens=room, plain=True))
        assert len(plain.token_ids) == room  # it runs right up to maxSeqLen
        drafted = generator.generate(Request(COUNTING, max_new_tokens=room))
    finally:
        drafter.close()
    print(f"room {room}, widest tree asked/answered {drafter.widest}, drafted {drafted.stats.draft_tokens}")
    assert drafted.token_ids == plain.token_ids
    assert drafter.widest > 2
    assert short.sessions == 0
