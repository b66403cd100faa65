"""The gateway's DraftSession against a real drafter on loopback: it verifies a prefix where rows are
cheap, goes plain where they are dear, backs off and probes again, and never loses a token."""

from __future__ import annotations

import struct
import uuid

import pytest

from pardec.gateway.clients import DrafterClient
from pardec.gateway.deadlines import Deadline, DeadlineExceeded
from pardec.gateway.drafter_health import DrafterBreaker
from pardec.verifier.api import Verification
from pardec.runtime.draft_params import DraftParams
from pardec.gateway.config import GatewayConfig, LoadPolicy
from pardec.gateway.drafting import DraftSession
from pardec.gateway.tree_sizing import CostCurve, accepted_nodes


def new_session(address, curve, policy=LoadPolicy(), params=DraftParams(decoding_length=8)):
    config = GatewayConfig(verifier_target="unused:1", drafter_target=address, load_policy=policy)
    session = DraftSession(DrafterClient(address, 10.0, 10.0), uuid.uuid4().hex, params, config,
                           cost=CostCurve.from_points(curve))  # fmt: skip
    return session


def committed_tokens(servicer, session_id):
    """The tokens the drafter's session holds, read from its Redis."""
    raw = servicer.drafter.store._client.get(f"pardec:{{{session_id}}}:tokens") or b""
    return list(struct.unpack(f">{len(raw) // 4}I", raw))


TEXT = list(range(100, 140))


def test_draft_session_verifies_a_prefix_where_rows_are_cheap(drafter_on_loopback):
    address, _ = drafter_on_loopback
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)])  # rows nearly free
    session.start(TEXT + TEXT[:2])
    tokens, parents = session.propose([TEXT[2]], in_flight=1, max_depth=64, last_node_argmax=[])
    assert tokens == TEXT[3:11] and parents == list(range(-1, 7))  # the whole chain of 8
    session.end()


def test_draft_session_goes_plain_and_stops_asking_where_rows_are_dear(drafter_on_loopback):
    address, servicer = drafter_on_loopback
    # Every token of a step costs as much as the step itself, the drafter's estimates are
    # fine: no tree can pay, so the drafter is not even asked, and gets the tokens later.
    dear = [(1, 1, 30.0), (2, 1, 70.0), (64, 1, 64 * 35.0)]
    session = new_session(address, dear)
    session.start(TEXT + TEXT[:2])
    for token in TEXT[2:6]:
        assert session.propose([token], in_flight=1, max_depth=64, last_node_argmax=[]) == ([], [])
    assert committed_tokens(servicer, session._session_id) == TEXT + TEXT[:2]  # not asked
    session.end()


def test_draft_session_backs_off_when_trees_do_not_pay_and_hands_over_every_token(drafter_on_loopback):
    address, servicer = drafter_on_loopback
    # Rows are cheap but the session's drafts never hit: after the prior wears off, trees are
    # cut to nothing and the drafter is asked ever more rarely, yet it receives every token.
    curve = [(1, 1, 30.0), (2, 1, 33.0), (64, 1, 200.0)]
    session = new_session(address, curve, LoadPolicy(always_ask_below=0))  # every call counts
    prompt = TEXT + TEXT[:2]
    session.start(prompt)
    misses = list(range(500, 560))  # never in the prompt
    sizes, asked = [], 0
    new_tokens = [misses[0]]
    for token in misses[1:]:
        before = len(committed_tokens(servicer, session._session_id))
        tokens, parents = session.propose(new_tokens, in_flight=1, max_depth=64, last_node_argmax=[])
        asked += len(committed_tokens(servicer, session._session_id)) > before
        sizes.append(len(tokens))
        session.costs.observe(Verification([], token, [0] * (len(tokens) + 1), 30.0), len(tokens), 31.0, 1)
        new_tokens = [token]
    assert asked < len(misses) // 3, (asked, sizes)
    assert sizes[-10:] == [0] * 10
    # The drafter has every committed token in order once asked again. This loop runs no model,
    # so a probe it sent may still be in flight: it lands and is scored first, as it would within
    # a real step (while a probe is out the session only rests, so nothing overtakes it).
    if session._probe is not None:
        session._probe[0].exception()
        session._score_probe([], in_flight=1)
    session._pacing.record(True)
    session.propose(new_tokens, in_flight=1, max_depth=64, last_node_argmax=[])
    assert committed_tokens(servicer, session._session_id) == prompt + misses
    session.end()


def test_a_resting_session_probes_beside_plain_steps_and_drafts_again_once_the_text_copies(drafter_on_loopback):
    """While drafts miss, steps run plain and the drafter is only probed (asked beside a plain
    step, its tree scored against the token the model commits); once the text copies the
    prompt, a probe hits and trees are verified again. The drafter gets every token once, in order."""
    address, servicer = drafter_on_loopback
    session = new_session(address, [(1, 1, 30.0), (2, 1, 33.0), (64, 1, 200.0)], LoadPolicy(always_ask_below=0))
    prompt = TEXT + TEXT[:2]
    session.start(prompt)
    text = list(range(500, 520)) + TEXT  # new text, then a copy of the prompt
    committed, new_tokens, steps = 1, [text[0]], []  # steps: (position, nodes, accepted)
    while committed < len(text):
        if session._probe is not None:  # as when the verifier's forward outlasts the probe
            session._probe[0].exception()
        tokens, parents = session.propose(new_tokens, in_flight=1, max_depth=64, last_node_argmax=[])
        on_path = accepted_nodes(tokens, parents, text[committed:])
        accepted = [token for token, hit in zip(tokens, on_path) if hit]
        new_tokens = (accepted + text[committed + len(accepted):])[: len(accepted) + 1]
        session.costs.observe(Verification(accepted, new_tokens[-1], [0] * (len(tokens) + 1), 30.0), len(tokens), 31.0, 1)
        steps.append((committed, len(tokens), len(accepted)))
        committed += len(new_tokens)
    new_text = [(nodes, hits) for position, nodes, hits in steps if 5 <= position < 20]
    copy = [(nodes, hits) for position, nodes, hits in steps if position >= 20]
    assert all(nodes == 0 for nodes, _ in new_text), steps
    # Tries come 1, 2, 4, 8, then 16 plain steps apart here: the probe 16 tokens into the copy hits.
    assert sum(hits for _, hits in copy) >= 15 and len(copy) <= 25, steps
    recorded = committed_tokens(servicer, session._session_id)
    assert recorded == (prompt + text)[: len(recorded)] and len(recorded) > len(prompt) + 20
    session.end()


def test_a_cheap_drafter_call_is_made_every_step_even_when_trees_do_not_pay(drafter_on_loopback):
    address, servicer = drafter_on_loopback
    # A call takes ~1 ms of a 200 ms step, under 5% (LoadPolicy.always_ask_below) with room for
    # calls of up to ~10 ms: on a busy 2-core CI machine some took over 3 ms, 5% of 60 ms.
    session = new_session(address, [(1, 1, 200.0), (2, 1, 220.0), (64, 1, 1333.0)])
    assert drafter_calls_over_new_text(session, servicer, in_flight=1, forward_ms=200.0) == 20
    session.end()


def test_drafter_calls_are_paid_for_by_every_request_in_flight(drafter_on_loopback):
    """A call that is cheap for one request is not for sixteen: their calls share the machine
    with the verifier, so under load a session that gains nothing stops asking."""
    address, servicer = drafter_on_loopback
    session = new_session(address, [(1, 1, 30.0), (2, 1, 33.0), (64, 1, 200.0)], LoadPolicy(plain_from=0))
    assert drafter_calls_over_new_text(session, servicer, in_flight=16) <= 8  # 1 ask, then skips of 1, 2, 4, 8 steps
    session.end()


def drafter_calls_over_new_text(session, servicer, in_flight: int, forward_ms: float | None = None) -> int:
    """Starts the session on TEXT, commits 20 tokens it never saw (no tree can pay) and counts
    the steps that asked the drafter; with forward_ms, each step is observed as that long."""
    session.start(TEXT + TEXT[:2])
    asked, new_tokens = 0, [500]
    for token in range(501, 521):
        before = len(committed_tokens(servicer, session._session_id))
        tokens, _ = session.propose(new_tokens, in_flight=in_flight, max_depth=64, last_node_argmax=[])
        asked += len(committed_tokens(servicer, session._session_id)) > before
        if forward_ms is not None:
            verification = Verification([], token, [0] * (len(tokens) + 1), forward_ms)
            session.costs.observe(verification, len(tokens), forward_ms + 1.0, in_flight)
        new_tokens = [token]
    return asked


def test_plain_from_is_a_hard_switch(drafter_on_loopback):
    address, _ = drafter_on_loopback
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)], LoadPolicy(plain_from=4))
    session.start(TEXT + TEXT[:2])
    assert session.propose([TEXT[2]], in_flight=4, max_depth=64, last_node_argmax=[]) == ([], [])
    assert session.propose([TEXT[3]], in_flight=3, max_depth=64, last_node_argmax=[])[0] == TEXT[4:12]
    session.end()


def test_a_request_admitted_above_plain_from_starts_its_drafter_session_only_once_it_may_draft(drafter_on_loopback):
    """Above plain_from no step drafts, so StartSession waits: a request that never drafts costs
    the drafter and Redis nothing. Once load drops, the session starts from the prompt and the
    first Propose brings every token committed meanwhile."""
    address, servicer = drafter_on_loopback
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)], LoadPolicy(plain_from=4))
    session.start(TEXT + TEXT[:2], defer=True)
    for token in TEXT[2:5]:
        assert session.propose([token], in_flight=4, max_depth=64, last_node_argmax=[]) == ([], [])
    assert not session.opened and committed_tokens(servicer, session._session_id) == []
    assert session.propose([TEXT[5]], in_flight=3, max_depth=64, last_node_argmax=[])[0] == TEXT[6:14]
    assert session.opened and committed_tokens(servicer, session._session_id) == TEXT + TEXT[:6]
    session.end()


def test_a_step_the_load_governor_runs_plain_asks_nothing_and_loses_no_token(drafter_on_loopback):
    address, servicer = drafter_on_loopback
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)], LoadPolicy(plain_from=0))
    session.start(TEXT + TEXT[:2])
    for token in TEXT[2:5]:
        assert session.propose([token], in_flight=16, max_depth=64, last_node_argmax=[], drafting=False) == ([], [])
    session._client.wait_started(session._started, 10.0)
    assert committed_tokens(servicer, session._session_id) == TEXT + TEXT[:2]  # not asked
    assert session.propose([TEXT[5]], in_flight=16, max_depth=64, last_node_argmax=[])[0] == TEXT[6:14]
    assert committed_tokens(servicer, session._session_id) == TEXT + TEXT[:6]
    session.end()


def test_drafter_client_gets_best_first_estimates(drafter_on_loopback):
    address, _ = drafter_on_loopback
    client, session_id = DrafterClient(address, 10.0, 10.0), uuid.uuid4().hex
    client.wait_started(client.start_session(session_id, [1, 2, 3, 1, 2, 4, 1, 2], DraftParams()), 10.0)
    tokens, parents, probabilities = client.propose(session_id, [], 16, 8, verified_depth=0)
    # drafter/trie.py's example (branch length 3 there, 12 here: the paths go on): the copy
    # chain [4, 1] at 2/3 and 4/9, then the trie's [3] and [3, 1].
    assert (tokens[:4], parents[:4]) == ([4, 1, 3, 1], [-1, 0, -1, 2])
    assert probabilities[:4] == pytest.approx([2 / 3, 4 / 9, 0.4, 0.32], abs=1e-6)
    assert len(probabilities) == len(tokens) and probabilities == sorted(probabilities, reverse=True)
    client.end_session(session_id)


def test_a_session_that_ran_plain_for_longer_than_one_propose_carries_drafts_again(drafter_on_loopback):
    """The drafter takes at most 513 new tokens a call (one step's path and bonus token); after
    600 steps the load governor ran plain, the session hands them over in pieces and drafts."""
    address, servicer = drafter_on_loopback
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)], LoadPolicy(plain_from=0))
    prompt = TEXT + TEXT[:2]
    session.start(prompt)
    plain_run = [500 + i % 300 for i in range(600)] + TEXT[:2]
    for token in plain_run:
        assert session.propose([token], in_flight=16, max_depth=64, last_node_argmax=[], drafting=False) == ([], [])
    assert session.propose([TEXT[2]], in_flight=16, max_depth=64, last_node_argmax=[])[0] == TEXT[3:11]
    assert committed_tokens(servicer, session._session_id) == prompt + plain_run + TEXT[2:3]
    session.end()


def test_a_requests_own_short_deadline_says_nothing_of_the_drafter(drafter_on_loopback):
    """A drafter start still running when a request's deadline leaves only a few ms is no sign
    of a hung drafter: two such requests do not open the gateway-wide breaker, which would send
    every request admitted in the next seconds plain for its whole life."""
    address, _ = drafter_on_loopback
    breaker = DrafterBreaker()
    for _ in range(3):
        config = GatewayConfig(verifier_target="unused:1", drafter_target=address)
        session = DraftSession(DrafterClient(address, 10.0, 10.0), uuid.uuid4().hex, DraftParams(), config,
                               breaker=breaker)
        session.start(list(range(1000, 31000)))  # a long prompt: its start takes Redis a while
        try:
            session.propose([7], in_flight=1, max_depth=8, last_node_argmax=[], deadline=Deadline.after(0.002))
        except DeadlineExceeded:
            pass
        session.end(wait=False)
    assert breaker.allows()
