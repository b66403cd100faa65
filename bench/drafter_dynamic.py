"""dynamic_algo against fixed candidate lengths on a mixed workload (simulated verifier).

    python -m bench.drafter_dynamic [--answer-tokens 300] [--per-node-cost 0.06]

No model runs: the "model" is a known answer, so greedy acceptance is exact (the longest path
of the tree that matches the answer) and each step's cost comes from a linear cost model,
cost(step) = 1 + per_node_cost * nodes in units of a plain decoding step (README: a 16-node step
is ~1.9x a 1-token step on this project's CPU, so 0.06). The drafter is the real one (SessionStore
over a private redis-server). Texts are Python standard-library sources, word-tokenized:

- copy:  the answer is the prompt's code with an identifier renamed (code editing: drafts hit)
- novel: the answer is another module's code (drafts rarely hit)

Prints, per configuration, the speedup over plain decoding (tokens per unit cost) for each kind
and for the mix (all answers together).
"""

from __future__ import annotations

import argparse
import inspect
import re
import tempfile
import uuid

import redis

from drafter.redis_server import RedisServer
from drafter.sessions import DraftSettings, SessionStore

MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "heapq", "bisect", "getopt", "glob", "tabnanny", "quopri")


class WordTokenizer:
    def __init__(self):
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.ids.setdefault(word, len(self.ids)) for word in re.findall(r"\w+|[^\w\s]|\s+", text)]


def workload(tokenize, length: int) -> list[tuple[str, list[int], list[int]]]:
    sources = [inspect.getsource(__import__(name)) for name in MODULES]
    cases = []
    for index, source in enumerate(sources):
        words = re.findall(r"[A-Za-z_]\w{3,}", source)
        renamed = max(set(words), key=words.count)
        prompt = tokenize(source)[: 2 * length]
        edited = tokenize(source.replace(renamed, renamed + "_v2"))[:length]
        cases.append(("copy", prompt, edited))
        other = tokenize(sources[(index + 3) % len(sources)])
        cases.append(("novel", prompt, other[len(other) // 2 : len(other) // 2 + length]))
    return cases


def simulate(store, settings, max_nodes, prompt, answer, per_node_cost) -> tuple[int, float]:
    """(tokens produced, cost) for one generation; answer[0] comes from the prefill."""
    session = f"dyn-{uuid.uuid4().hex}"
    store.start_session(session, prompt, settings)
    position, new_tokens, cost = 1, answer[:1], 0.0
    while position < len(answer):
        tokens, parents = store.propose(session, new_tokens, [], max_nodes, len(answer) - position)
        row, accepted = -1, []
        while position + len(accepted) < len(answer):
            want = answer[position + len(accepted)]
            child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == row and t == want), None)
            if child is None:
                break
            accepted.append(want)
            row = child
        position += len(accepted)
        new_tokens = [*accepted, *answer[position : position + 1]]
        position += 1
        cost += 1.0 + per_node_cost * len(tokens)
    store.end_session(session)
    return len(answer) - 1, cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answer-tokens", type=int, default=300)
    parser.add_argument("--per-node-cost", type=float, default=0.06)
    args = parser.parse_args()
    cases = workload(WordTokenizer(), args.answer_tokens)
    configs = [(f"fixed {n}", DraftSettings(decoding_length=n), n) for n in (1, 2, 3, 4, 6, 8, 12, 16)]
    configs.append(("dynamic_algo (max 16)", DraftSettings(decoding_length=16, dynamic_algo=True), 16))
    with tempfile.TemporaryDirectory(prefix="pdd-", dir="/tmp") as workdir, RedisServer(workdir) as server:
        store = SessionStore(redis.Redis.from_url(server.url))
        print(f"per-node cost {args.per_node_cost}; speedup = tokens per unit cost vs plain decoding\n")
        print("| configuration | copy | novel | mix |")
        print("|---|---:|---:|---:|")
        for name, settings, max_nodes in configs:
            totals = {"copy": [0, 0.0], "novel": [0, 0.0]}
            for kind, prompt, answer in cases:
                tokens, cost = simulate(store, settings, max_nodes, prompt, answer, args.per_node_cost)
                totals[kind][0] += tokens
                totals[kind][1] += cost
            speedups = [totals[kind][0] / totals[kind][1] for kind in ("copy", "novel")]
            mix = sum(t for t, _ in totals.values()) / sum(c for _, c in totals.values())
            print(f"| {name} | {speedups[0]:.2f}x | {speedups[1]:.2f}x | {mix:.2f}x |")


if __name__ == "__main__":
    main()
