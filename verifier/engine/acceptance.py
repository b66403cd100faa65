"""Tree structure and lossless acceptance: pure functions over tensors, no model, no I/O.

A step's forward input is the root (the session's last committed token) followed by the
draft nodes, so row 0 holds the root and row i + 1 holds node i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from pardec.runtime.errors import InvalidArgument
from pardec.verifier.api import Sampling, TokenLogprob


@dataclass(frozen=True)
class StepLayout:
    """Forward inputs of one step: depths [T] and ancestor mask [T, T], T = 1 + nodes."""

    depths: torch.Tensor
    ancestors: torch.Tensor
    children: tuple[dict[int, int], ...]  # row -> {token: child row}; first child wins


def tree_layout(root_token: int, tokens: Sequence[int], parents: Sequence[int], vocab_size: int) -> StepLayout:
    """Validates a draft tree and lays it out for the forward.

    >>> layout = tree_layout(7, [5, 6, 9], [-1, 0, -1], vocab_size=10)
    >>> layout.depths.tolist()
    [0, 1, 2, 1]
    >>> layout.ancestors.int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    >>> layout.children
    ({5: 1, 9: 3}, {6: 2}, {}, {})
    """
    if len(tokens) != len(parents):
        raise InvalidArgument(
            f"tree.parents: must have one entry per token ({len(tokens)}), got {len(parents)}"
        )
    rows = len(tokens) + 1
    depths = [0] * rows
    # Each row's ancestor rows as Python lists, one tensor made at the end: indexing a torch
    # tensor row by row cost more than the rest of the step's host work on a 16-node tree.
    ancestors: list[list[bool]] = [[True] + [False] * (rows - 1)]
    children: list[dict[int, int]] = [{} for _ in range(rows)]
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"tree.token_ids[{node}]: {token} is outside the vocabulary [0, {vocab_size})")
        if not -1 <= parent < node:
            raise InvalidArgument(
                f"tree.parents[{node}]: {parent} must be -1 (root) or an earlier node index (< {node})"
            )
        row, parent_row = node + 1, parent + 1
        depths[row] = depths[parent_row] + 1
        line = ancestors[parent_row].copy()
        line[row] = True
        ancestors.append(line)
        children[parent_row].setdefault(token, row)
    if not 0 <= root_token < vocab_size:
        raise InvalidArgument(f"root token {root_token} is outside the vocabulary")
    return StepLayout(torch.tensor(depths, dtype=torch.int64), torch.tensor(ancestors, dtype=torch.bool), tuple(children))


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty: logits of tokens in ``seen`` are divided by ``penalty`` when
    positive and multiplied by it when negative. ``logits`` [V], ``seen`` int64 [S]."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    logits = logits.double()  # a penalty near 0 (or huge) pushes float32 logits to +-inf
    picked = logits.index_select(0, seen)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.index_copy(0, seen, picked)


def penalize_output(logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's penalties: each token the output holds loses ``presence`` once and ``frequency``
    per time it holds it. ``logits`` [V], ``counts`` [V] (how often the output holds each token).
    A token held at -inf stays there, whatever the sign of the penalties.

    >>> penalize_output(torch.zeros(4), torch.tensor([0.0, 1.0, 3.0, 0.0]), 0.5, 0.25).tolist()
    [0.0, -0.75, -1.25, 0.0]
    """
    return logits.double() - frequency * counts - presence * (counts > 0).double()


def output_counts(history: torch.Tensor, generated: int, vocab_size: int) -> torch.Tensor:
    """How often each token [V] appears among the last ``generated`` tokens of ``history`` (the
    output's; the prompt's do not count, as in OpenAI's and vLLM's penalties).

    >>> output_counts(torch.tensor([3, 3, 1, 1, 2]), 3, 4).tolist()
    [0.0, 2.0, 1.0, 0.0]
    """
    output = history[history.numel() - generated:]
    return torch.bincount(output, minlength=vocab_size)[:vocab_size].double()


def choose_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token from a row of (already penalised) logits [V]: argmax when greedy, else a
    draw from the temperature / min-p / top-k / top-p filtered distribution (vLLM's order)."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    scaled = logits.double() / sampling.temperature
    if sampling.min_p > 0.0:
        # A token whose probability is below min_p times the likeliest's: its log-probability
        # trails the largest by more than -log(min_p).
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(sampling.min_p), float("-inf"))
    if 0 < sampling.top_k < scaled.numel():
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if 0.0 < sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep each token whose preceding mass is below top_p: the smallest set reaching it.
        keep = (torch.cumsum(sorted_probs, 0) - sorted_probs) < sampling.top_p
        probs = torch.zeros_like(probs).index_copy(0, order, sorted_probs * keep)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class Acceptance:
    accepted_rows: list[int]  # rows of accepted draft nodes, root to leaf
    bonus_token: int


def accept(
    logits: torch.Tensor,
    layout: StepLayout,
    row_tokens: Sequence[int],
    history: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    generated: int = 0,
) -> Acceptance:
    """Walks the tree from the root, keeping exactly what the model would have produced.

    At each visited row, the next token is chosen from that row's distribution (penalised
    with the row's own prefix: ``history`` plus the row's ancestors, of which the last
    ``generated`` tokens of ``history`` and the ancestors are output), once, with a fresh draw.
    If a child carries it, the walk descends; otherwise it is the bonus token. With drafts
    fixed in advance this is lossless for greedy and sampling alike, and it consumes one draw
    per generated token, so a seeded request gives the same tokens with or without drafting.

    >>> layout = tree_layout(7, [5, 6, 9], [-1, 0, -1], vocab_size=10)
    >>> logits = torch.full((4, 10), -1.0)
    >>> logits[0, 5] = logits[1, 6] = logits[2, 3] = 1.0  # root -> 5 -> 6 -> bonus 3
    >>> accept(logits, layout, [7, 5, 6, 9], torch.tensor([7]), Sampling(), None)
    Acceptance(accepted_rows=[1, 2], bonus_token=3)
    """
    accepted: list[int] = []
    row = 0
    path_tokens = [row_tokens[0]]
    counts = None  # the output's token counts along the path, for presence and frequency
    if sampling.presence_penalty or sampling.frequency_penalty:
        counts = output_counts(history, generated, logits.shape[-1])
    while True:
        row_logits = logits[row]
        if sampling.repetition_penalty != 1.0:
            # history already ends with the root; add the accepted nodes along the path.
            seen = torch.unique(torch.cat([history, torch.tensor(path_tokens[1:], dtype=torch.int64)]))
            row_logits = penalize_repetition(row_logits, seen, sampling.repetition_penalty)
        if counts is not None:
            row_logits = penalize_output(row_logits, counts, sampling.presence_penalty, sampling.frequency_penalty)
        token = choose_token(row_logits, sampling, generator)
        child = layout.children[row].get(token)
        if child is None:
            return Acceptance(accepted, token)
        accepted.append(child)
        path_tokens.append(row_tokens[child])
        if counts is not None:
            counts[token] += 1
        row = child


def accept_argmax(argmax: Sequence[int], layout: StepLayout) -> Acceptance:
    """Greedy acceptance from each row's argmax alone: what `accept` does for greedy sampling
    without penalties, for an engine that takes the argmax on its device.

    >>> layout = tree_layout(7, [5, 6, 9], [-1, 0, -1], vocab_size=10)
    >>> accept_argmax([5, 6, 3, 0], layout)  # root -> 5 -> 6 -> bonus 3
    Acceptance(accepted_rows=[1, 2], bonus_token=3)
    """
    accepted: list[int] = []
    row = 0
    while True:
        child = layout.children[row].get(argmax[row])
        if child is None:
            return Acceptance(accepted, argmax[row])
        accepted.append(child)
        row = child


def constrain(
    logits: torch.Tensor, depths: torch.Tensor, generated: int, sampling: Sampling, allowed: torch.Tensor | None = None,
    banned: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The logits [rows, V] a choice is made from under the session's rules: only
    allowed_token_ids, logit_bias added, and the stop tokens at -inf in each row that predicts
    one of the first min_tokens tokens (row r predicts token ``generated + depths[r]``). Each
    row's own, element by element: a row gets the same logits alone, in a tree or in a batch, so
    acceptance stays lossless.

    >>> rules = Sampling(min_tokens=2, logit_bias=((1, 2.0),), stop_token_ids=(0,))
    >>> constrain(torch.zeros(3, 3), torch.tensor([0, 1, 2]), 0, rules).tolist()
    [[-inf, 2.0, 0.0], [-inf, 2.0, 0.0], [0.0, 2.0, 0.0]]
    >>> constrain(torch.zeros(1, 3), torch.tensor([0]), 0, Sampling(allowed_token_ids=(2,))).tolist()
    [[-inf, -inf, 0.0]]

    ``allowed`` (bool [rows, V], a structured output's, grammar.allowed_rows) masks the rest;
    in a row where the rules leave none of its tokens (min_tokens against a language that must
    end now), the language wins: that row's raw logits under its mask alone.

    >>> constrain(torch.zeros(1, 3), torch.tensor([0]), 0, rules, torch.tensor([[True, False, False]])).tolist()
    [[0.0, -inf, -inf]]

    ``banned`` (each row's tokens bad words ban there, path_rules.RuledMatcher) go last, each
    row's ban yielding where it would leave the row no token:

    >>> constrain(torch.zeros(2, 3), torch.tensor([0, 1]), 0, Sampling(allowed_token_ids=(1, 2)), None, [[1], [1, 2]]).tolist()
    [[-inf, -inf, 0.0], [-inf, 0.0, 0.0]]
    """
    if banned:
        return ban(constrain(logits, depths, generated, sampling, allowed), banned)
    if allowed is not None:
        forbidden = ~allowed.to(logits.device)
        ruled = constrain(logits, depths, generated, sampling).masked_fill(forbidden, float("-inf"))
        stuck = ~torch.isfinite(ruled).any(dim=-1)  # [rows]
        return torch.where(stuck.unsqueeze(1), logits.masked_fill(forbidden, float("-inf")), ruled)
    if not sampling.constrains:
        return logits
    logits = logits.clone()
    device = logits.device
    if sampling.allowed_token_ids:
        allowed = torch.full_like(logits[0], float("-inf"))
        allowed[torch.tensor(sampling.allowed_token_ids, device=device)] = 0.0
        logits += allowed
    if sampling.logit_bias:
        tokens, biases = zip(*sampling.logit_bias)
        logits[:, torch.tensor(tokens, device=device)] += torch.tensor(biases, dtype=logits.dtype, device=device)
    if sampling.min_tokens > generated and sampling.stop_token_ids:
        early = (depths.to(device) + generated) < sampling.min_tokens  # [rows]
        held = torch.tensor(sampling.stop_token_ids, device=device)
        logits[early.nonzero().squeeze(1).unsqueeze(1), held] = float("-inf")
    return logits


def ban(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """``logits`` [rows, V] with each row's ``banned`` tokens at -inf, but in a row they would
    leave no finite logit."""
    pairs = [(row, token) for row, tokens in enumerate(banned) for token in tokens]
    if not pairs:
        return logits
    rows, tokens = (torch.tensor(column, dtype=torch.int64, device=logits.device) for column in zip(*pairs))
    finite = torch.isfinite(logits)
    left = finite.sum(dim=-1) - torch.zeros_like(finite[:, 0], dtype=torch.int64).index_add_(
        0, rows, finite[rows, tokens].to(torch.int64))  # [rows]: finite logits the bans would leave
    held = left[rows] > 0
    logits = logits.clone()
    logits[rows[held], tokens[held]] = float("-inf")
    return logits


def accept_step(
    logits: torch.Tensor, layout: StepLayout, row_tokens, history, sampling: Sampling, generator, generated: int = 0,
    allowed: torch.Tensor | None = None, banned: Sequence[Sequence[int]] | None = None,
):
    """Acceptance, and every row's argmax. Greedy without penalties needs only each
    row's argmax, taken where the logits are (on a GPU: a few bytes to the host instead of the
    whole [rows, vocab] block); otherwise the rows go to the host for `accept`, with the
    session's tokens (`history`, a callable: made only then). ``generated``: the tokens the
    session generated before row 0's (for min_tokens); the rules apply first (`constrain`), with
    a structured output's ``allowed`` tokens and the ``banned`` ones."""
    if sampling.greedy and not sampling.penalizes:
        logits = constrain(logits, layout.depths, generated, sampling, allowed)
        argmax = argmax_rows(logits)
        for row, tokens in enumerate(banned or ()):  # a ban only lowers logits: only a banned argmax moves
            if argmax[row] in tokens:
                argmax[row] = argmax_rows(ban(logits[row:row + 1], [tokens]))[0]
        return accept_argmax(argmax, layout), argmax
    logits = constrain(logits, layout.depths, generated, sampling, allowed, banned).cpu()
    return accept(logits, layout, row_tokens, history(), sampling, generator, generated), argmax_rows(logits)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, a NaN counting as the maximum, as torch's).
    On CPU through numpy, whose reduction over a [rows, vocab] block of fp32 logits is the faster
    (benchmarks.md, "Figures behind design choices"), on every step.

    >>> argmax_rows(torch.tensor([[0.0, 2.0, 2.0], [float("nan"), 1.0, float("nan")], [1.0, 0.0, 3.0]]))
    [1, 0, 2]
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


# Rows scored at once: bounds the fp32 copies a log-softmax makes of [rows, vocab] logits.
LOGPROB_ROWS = 64


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-probability of ``tokens[i]`` in row ``rows[i]`` of ``logits`` [rows, V], with the
    ``top`` most likely tokens of that row: the log-softmax of the raw logits in fp32, whatever
    the sampling (vLLM's default), so the figures do not depend on how the token was chosen.

    >>> logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.125, 0.125, 0.75]]))
    >>> [(round(lp, 3), [(t, round(p, 3)) for t, p in top]) for lp, top in token_logprobs(logits, [1, 0], [2, 1], top=1)]
    [(-0.288, [(2, -0.288)]), (-1.386, [(0, -0.693)])]
    """
    rows, tokens, out = list(rows), list(tokens), []
    # A block of rows at a time: a scored prompt chunk is hundreds of rows of a large vocabulary.
    for start in range(0, len(rows), LOGPROB_ROWS):
        block = slice(start, start + LOGPROB_ROWS)
        log_probs = torch.log_softmax(logits[rows[block]].float(), dim=-1)  # [block, V]
        index = torch.tensor(tokens[block], dtype=torch.int64, device=log_probs.device).unsqueeze(1)
        chosen = log_probs.gather(1, index).squeeze(1).tolist()
        if top == 0:
            out += [TokenLogprob(value) for value in chosen]
            continue
        values, ids = torch.topk(log_probs, min(top, log_probs.shape[-1]), dim=-1)
        out += [TokenLogprob(value, tuple(zip(row_ids, row_values)))
                for value, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist())]
    return out
