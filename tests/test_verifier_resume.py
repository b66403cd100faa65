"""Resume prefill: a session rebuilt from prompt + generated tokens on another replica continues
exactly as it would have on the replica it left (the gateway's failover, gateway/replicas.py)."""

from __future__ import annotations

import pytest

from pardec.runtime.errors import InvalidArgument
from pardec.verifier.api import Sampling


def test_resume_prefill_gives_the_token_the_original_session_would_give(engine):
    prompt = engine.tokenizer.encode_chat("Count from one to twenty in words, separated by commas.")
    committed = [engine.prefill("original", prompt, Sampling(), None).token]
    for _ in range(6):  # plain steps: the root is the last committed token
        committed.append(engine.verify("original", [], []).bonus_token)
    expected_next = engine.verify("original", [], []).bonus_token
    engine.release("original")

    resumed = engine.prefill("moved", prompt + committed, Sampling(), None, resume=True).token
    assert resumed == expected_next
    engine.release("moved")


def test_resume_is_bounded_by_max_seq_len_and_a_prompt_by_max_input_tokens(engine):
    config = engine.config
    too_long_prompt = [1] * (config.max_input_tokens + 1)
    with pytest.raises(InvalidArgument, match="max_input_tokens"):
        engine.prefill("p", too_long_prompt, Sampling(), None)
    with pytest.raises(InvalidArgument, match="max_seq_len"):
        engine.prefill("p", [1] * config.max_seq_len, Sampling(), None, resume=True)
