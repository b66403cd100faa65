"""Drafting quality on the real model: plain vs memory_decoding vs lookahead, greedy.

    python -m pardec.bench.drafter_quality [--workload mtbench] [--prompts 3] [--max-new-tokens 64]
                                    [--modes "memory_decoding 16,lookahead 4/5/5"]

Runs the verifier engine in-process (the bundled model, W8A8, CPU) and the real drafter store
over a private redis-server, with the gateway's loop reduced to its core: propose (with the
previous step's per-node argmax), verify, commit. Checks that every parallel output equals the
plain output token for token, and prints per mode: forward steps, mean accepted length, draft
nodes per step and the verifier's compute time (the sum of its per-step compute_ms), which on
this machine is most of a step's cost.

Every step verifies the drafter's whole tree (the gateway's sizing, which cuts trees to what
pays on this CPU, is left out), so the accepted lengths are the drafters' own. A last row
replays prompt lookup (k=10, transformers' matching rule) on plain's output: the two kinds of
drafter on the same text.
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from pathlib import Path

import redis

from pardec.bench import workloads
from pardec.bench.decode import InProcess, decode
from pardec.bench.peers import prompt_lookup_steps
from pardec.bench.stack import launch
from pardec.drafter.sessions import SessionStore
from pardec.runtime.draft_params import DraftParams
from pardec.verifier.config import VerifierConfig
from pardec.verifier.server import build_engine

MODES = {
    "plain": None,
    "memory_decoding 16": (DraftParams(decoding_length=16), 16),
    "md dynamic_algo 16": (DraftParams(decoding_length=16, dynamic_algo=True), 16),
    "lookahead 4/5/5": (DraftParams("la", level=4, window=5, guess_set_size=5), 30),
    "lookahead 5/7/7": (DraftParams("la", level=5, window=7, guess_set_size=7), 56),
}


class StoreDrafter:
    """A drafting session in the drafter's own store, in this process: the whole tree, no sizing."""

    def __init__(self, store: SessionStore, session_id: str, settings: DraftParams, max_nodes: int):
        self.store, self.session_id, self.settings, self.max_nodes = store, session_id, settings, max_nodes

    def start(self, prompt_ids):
        self.store.start_session(self.session_id, prompt_ids, self.settings)

    def propose(self, new_tokens, node_argmax, max_depth):
        return self.store.propose(self.session_id, new_tokens, node_argmax, self.max_nodes, max_depth)

    def observe(self, verified, nodes):
        pass

    def end(self, last_tokens):
        self.store.end_session(self.session_id)


def generate(engine, store, prompt_ids, mode, max_new):
    """Returns (tokens, steps, draft nodes, compute ms)."""
    session = f"q-{uuid.uuid4().hex}"
    drafter = mode and StoreDrafter(store, session, *mode)
    result = decode(InProcess(engine), session, prompt_ids, max_new, set(engine.tokenizer.stop_token_ids), drafter)
    return result.output, result.steps, result.nodes, result.compute_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mtbench", choices=workloads.WORKLOADS)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--modes", default=",".join(name for name in MODES if name != "plain"),
                        help=f"comma list of {', '.join(name for name in MODES if name != 'plain')} (plain always runs)")
    args = parser.parse_args()
    chosen = ["plain", *(name.strip() for name in args.modes.split(",") if name.strip())]
    unknown = [name for name in chosen if name not in MODES]
    if unknown:
        parser.error(f"--modes: {', '.join(unknown)} not among {', '.join(MODES)}")
    modes = {name: MODES[name] for name in dict.fromkeys(chosen)}
    engine = build_engine(VerifierConfig())
    prompts = workloads.load(args.workload, args.prompts)
    totals = {name: [0, 0, 0, 0.0] for name in modes}  # tokens, steps, nodes, compute ms
    identical = True
    lookup_steps = 0
    with tempfile.TemporaryDirectory(prefix="pdq-", dir="/tmp") as workdir, launch(Path(workdir)) as server:
        store = SessionStore(redis.Redis.from_url(server.redis_url))
        for prompt in prompts:
            prompt_ids = engine.tokenizer.encode_chat(prompt)
            plain = None
            for name, mode in modes.items():
                output, steps, nodes, compute_ms = generate(engine, store, prompt_ids, mode, args.max_new_tokens)
                if plain is None:
                    plain = output
                    lookup_steps += prompt_lookup_steps(prompt_ids, output, 10)
                identical &= output == plain
                for k, value in enumerate((len(output) - 1, steps, nodes, compute_ms)):
                    totals[name][k] += value
    engine.close()
    print(f"{args.workload}: {len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy; "
          f"outputs identical to plain: {'yes' if identical else 'NO'}\n")
    print("| mode | steps | mean accepted length | nodes/step | verifier compute s | vs plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (tokens, steps, nodes, compute_ms) in totals.items():
        print(f"| {name} | {steps} | {tokens / steps:.2f} | {nodes / steps:.1f} | {compute_ms / 1e3:.1f} | "
              f"{totals['plain'][3] / compute_ms:.2f}x |")
    print(f"| prompt lookup k=10, replayed | {lookup_steps} | {totals['plain'][0] / lookup_steps:.2f} | ≤10 | | |")


if __name__ == "__main__":
    main()
