"""Drafting ahead (gateway/draft_ahead.py): the pure tree cuts on literal arrays, and a
DraftSession with `overlap` against a real drafter on loopback: steps take their trees from the
tree drafted while the previous step verified, without a blocking call, and the drafter records
exactly the committed tokens, in order, as without overlap."""

from __future__ import annotations

import time
import uuid

import pytest

from pardec.gateway.clients import DrafterClient
from pardec.gateway.config import GatewayConfig, LoadPolicy
from pardec.gateway.draft_ahead import descend, overlap_applies, within_depth
from pardec.gateway.drafting import DraftSession
from pardec.gateway.tree_sizing import CostCurve, accepted_nodes
from pardec.runtime.draft_params import DraftParams
from pardec.runtime.errors import ConfigError, Unavailable
from pardec.runtime.serving import start_server
from pardec.verifier.api import Verification
from tests.test_gateway_draft_session import committed_tokens

# root -> 10 -> 11 -> {12, 13}; root -> 20 -> 21; root -> 30
TREE = ([10, 20, 11, 21, 12, 30, 13], [-1, -1, 0, 1, 2, -1, 2], [0.8, 0.5, 0.5, 0.4, 0.25, 0.2, 0.125])


def test_descend_follows_the_committed_tokens_and_rebases_the_estimates():
    assert descend(*TREE, []) == tuple(map(list, TREE))
    assert descend(*TREE, [10]) == ([11, 12, 13], [-1, 0, 0], [0.625, 0.3125, 0.15625])
    assert descend(*TREE, [10, 11]) == ([12, 13], [-1, -1], [0.5, 0.25])
    assert descend(*TREE, [20]) == ([21], [-1], [0.8])
    assert descend(*TREE, [10, 11, 12]) == ([], [], [])  # a leaf: found, nothing below
    assert descend(*TREE, [30, 5]) is None and descend(*TREE, [11]) is None and descend([], [], [], [1]) is None
    # Estimates above the reached node's own (a copy chain merged in) stay probabilities.
    assert descend([1, 2], [-1, 0], [0.5, 0.5], [1]) == ([2], [-1], [1.0])


def test_within_depth_keeps_every_prefix_a_tree():
    assert within_depth(*TREE, 1) == ([10, 20, 30], [-1, -1, -1], [0.8, 0.5, 0.2])
    assert within_depth(*TREE, 2) == ([10, 20, 11, 21, 30], [-1, -1, 0, 1, -1], [0.8, 0.5, 0.5, 0.4, 0.2])
    assert within_depth(*TREE, 3) == tuple(map(list, TREE))
    assert within_depth(*TREE, 0) == ([], [], [])


def test_overlap_applies_to_memory_decoding_on_accelerators_or_when_asked():
    assert overlap_applies("auto", "cuda:0", "memory_decoding", False)
    assert overlap_applies("auto", "npu:1", "memory_decoding", False)
    assert not overlap_applies("auto", "cpu", "memory_decoding", False)
    assert not overlap_applies("auto", "", "memory_decoding", False)  # a verifier that did not say
    assert overlap_applies("on", "cpu", "memory_decoding", False)
    assert not overlap_applies("off", "cuda:0", "memory_decoding", False)
    assert not overlap_applies("on", "cuda:0", "la", False)
    assert not overlap_applies("on", "cuda:0", "memory_decoding", True)
    with pytest.raises(ValueError, match="overlap_drafting"):
        overlap_applies("always", "cpu", "memory_decoding", False)
    with pytest.raises(ConfigError, match="overlap_drafting: must be one of auto, on, off, got 'yes'"):
        GatewayConfig(verifier_target="v:1", drafter_target="d:1", overlap_drafting="yes")


class CountingClient(DrafterClient):
    """The real client, counting the calls a step waits for and those it does not."""

    def __init__(self, *args):
        super().__init__(*args)
        self.blocking = self.ahead = 0

    def propose(self, *args, **kwargs):
        self.blocking += 1
        return super().propose(*args, **kwargs)

    def propose_future(self, *args, **kwargs):
        self.ahead += 1
        return super().propose_future(*args, **kwargs)


def stepping(session, text, committed=1):
    """Steps a session through `text` as a greedy model would: each step accepts the tree's
    path along the text and adds the text's next token. Yields each step's nodes, accepted
    tokens and committed tokens (which only the next call carries). The text's first
    `committed` tokens are committed, the last of them by the step before (the prefill's token: 1)."""
    new_tokens = [text[committed - 1]]
    while committed < len(text):
        tokens, parents = session.propose(new_tokens, in_flight=1, max_depth=64, last_node_argmax=[])
        on_path = accepted_nodes(tokens, parents, text[committed:])
        accepted = [token for token, hit in zip(tokens, on_path) if hit]
        new_tokens = text[committed: committed + len(accepted) + 1]
        assert new_tokens[: len(accepted)] == accepted
        session.costs.observe(Verification(accepted, new_tokens[-1], [0] * (len(tokens) + 1), 5.0), len(tokens), 6.0, 1)
        committed += len(new_tokens)
        yield len(tokens), len(accepted), new_tokens


def decode(session, text, committed=1):
    """`stepping` to the end: (nodes, accepted) per step, and the last step's tokens."""
    steps = [(nodes, accepted, tokens) for nodes, accepted, tokens in stepping(session, text, committed)]
    return [(nodes, accepted) for nodes, accepted, _ in steps], steps[-1][2]


def handed_over(servicer, session):
    """What the drafter holds once the call in flight has landed (as within the next step),
    with what is pending."""
    if session._ahead_call is not None:
        assert session._ahead_call[0].exception() is None
    return committed_tokens(servicer, session._session_id) + session._pending


PROMPT = list(range(100, 160)) + list(range(300, 340))
TEXT = list(range(100, 160)) + [7, 8] + list(range(300, 340))  # the prompt's two parts, then a new pair


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "ahead"])
def test_steps_take_their_trees_from_the_tree_drafted_ahead_and_the_drafter_records_exactly_the_text(drafter_on_loopback, overlap):
    address, servicer = drafter_on_loopback
    client = CountingClient(address, 10.0, 10.0)
    config = GatewayConfig(verifier_target="unused:1", drafter_target=address, load_policy=LoadPolicy(always_ask_below=0))
    session = DraftSession(client, uuid.uuid4().hex, DraftParams(decoding_length=8), config,
                           cost=CostCurve.from_points([(1, 1, 5.0), (64, 1, 5.5)]), overlap=overlap)  # fmt: skip
    session.start(PROMPT)
    steps, last = decode(session, TEXT)
    assert sum(accepted for _, accepted in steps) >= len(TEXT) // 2, steps  # the copies are drafted
    # Every token once, in order, and nothing the model did not commit.
    assert handed_over(servicer, session) + last == PROMPT + TEXT
    session.end()
    if overlap:
        # Once a tree was drafted deep enough, the steps along a copy find theirs in the tree
        # drafted while the previous step verified: few calls are waited for.
        assert client.ahead >= 5 and client.blocking <= len(steps) // 2, (client.blocking, client.ahead, steps)
    else:
        assert client.ahead == 0


def test_a_failed_ahead_call_loses_no_token(drafter_on_loopback):
    """The drafter refuses calls for a while (its server stopped): the tokens an ahead call
    carried are sent again once it is back, so the drafter still holds the whole text."""
    address, servicer = drafter_on_loopback
    server, moving = start_server([servicer.add_to], "127.0.0.1:0")
    client = CountingClient(moving, 10.0, 10.0)
    config = GatewayConfig(verifier_target="unused:1", drafter_target=moving, drafter_retry_s=0.0,
                           load_policy=LoadPolicy(always_ask_below=0))  # fmt: skip
    session = DraftSession(client, uuid.uuid4().hex, DraftParams(decoding_length=8), config,
                           cost=CostCurve.from_points([(1, 1, 5.0), (64, 1, 5.5)]), overlap=True)  # fmt: skip
    session.start(PROMPT)
    committed = 1
    for _, _, last in stepping(session, TEXT, 1):
        committed += len(last)
        if session._ahead_call is not None and committed > 20:
            break
    # The call in flight lands (a race with the stop otherwise); the one the next step sends fails.
    session._ahead_call[0].result(timeout=10)
    server.stop(None).wait()
    session.propose(last, in_flight=1, max_depth=64, last_node_argmax=[])
    assert session._ahead_call is not None and session._ahead_call[0].exception(timeout=10) is not None
    committed += 1  # the model accepts none of that step's tree
    server, _ = start_server([servicer.add_to], moving)
    try:
        for _ in range(50):  # until the client's channel has reconnected
            try:
                client.end_session("no-such-session")
                break
            except Unavailable:
                time.sleep(0.1)
        _, last = decode(session, TEXT, committed)
        assert handed_over(servicer, session) + last == PROMPT + TEXT
        session.end()
    finally:
        server.stop(None).wait()
