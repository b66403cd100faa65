"""Steps of a forward for the engine tests: a chain of tokens, a session prefilled in chunks, and
how a structured output's language reads a text."""

import torch

from pardec.verifier.engine.acceptance import tree_layout
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


def decode_session(engine, prompt, sampling, steps, trees=None, generated=0):
    """A session's tokens on `engine`: its prefill's, then `steps` verify steps, plain or with the
    trees `trees(tokens so far)` gives; with `generated`, resumed (the prompt's last tokens are output)."""
    import uuid

    session = uuid.uuid4().hex
    tokens = [engine.prefill(session, prompt, sampling, sampling.seed, resume=bool(generated),
                             generated=generated).token]
    try:
        for _ in range(steps):
            verified = engine.verify(session, *(trees(tokens) if trees else ([], [])))
            tokens += [*verified.accepted_tokens, verified.bonus_token]
    finally:
        engine.release(session)
    return tokens


def plain_chain(plain, vocab_size):
    """Trees drafting `plain` decoding's continuation: a wrong sibling first, then a chain of the next
    four tokens, so some are accepted and the wrong one never is."""

    def trees(committed):
        ahead = plain[len(committed): len(committed) + 4]
        return [(ahead[0] + 1) % vocab_size, *ahead], [-1, -1, *range(1, len(ahead))]

    return trees


def language_reads(engine, language, text: str) -> str:
    """How ``language`` (a StructuredOutput) reads ``text``: "whole" (it may end there), "prefix" or "refused"."""
    matcher = engine.grammars.matcher(language)
    try:
        matcher.advance(engine.tokenizer.encode_text(text))
    except RuntimeError:
        return "refused"
    row = matcher.allowed_rows(tree_layout(0, [], [], engine.vocab_size))[0]
    return "whole" if row[engine.tokenizer.stop_token_ids[0]] else "prefix"
