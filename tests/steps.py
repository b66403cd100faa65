"""Steps of a forward for the engine tests: a chain of tokens, and a session prefilled in chunks."""

import torch

from pardec.verifier.model.step import StepInput


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def chain_step(tokens, cache, output_rows=None) -> StepInput:
    """Tokens that each follow the previous one (a prompt chunk, or plain decoding's one token)."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    n = tokens.shape[0]
    return StepInput(tokens, torch.arange(n), causal(n), cache, output_rows)


def prefill(model, pool, prompt, chunks=None):
    """A new session of `pool` holding `prompt`, cached in one forward or in `chunks`."""
    cache = pool.session()
    cache.reserve(len(prompt))
    done = 0
    for size in chunks or [len(prompt)]:
        model.forward_batch([chain_step(prompt[done : done + size], cache)])
        cache.commit(torch.arange(size), trim=False)
        done += size
    return cache


def assert_nodes_are_plain_decoding(model, pool, prompt, tokens, parents, logits):
    """Each tree node's logits (`logits` [nodes, vocab], from one forward of the tree after
    `prompt`) are bit-identical to plain decoding's down its path: one token a step, committed."""
    for leaf in sorted(set(range(len(parents))) - set(parents)):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        cache = prefill(model, pool, prompt)
        for node in reversed(path):
            cache.reserve(1)
            plain = model.forward_batch([chain_step(tokens[node : node + 1], cache)])[0]
            cache.commit(torch.tensor([0]))
            assert torch.equal(plain[0], logits[node]), f"node {node} differs from plain decoding"
