"""Verifier engine throughput with and without continuous batching, and its step cost curve.

    python -m pardec.bench.verifier_batching [--sessions 1 4 16] [--new-tokens 32] [--style plain|ngram]
                                      [--rounds 1] [--cost-curve] [--prefill 1000]

Calls the Engine directly (no gRPC), one client thread per session, as the gateway's worker
threads do. Each session prefills, waits for the others, then decodes --new-tokens greedily;
decode tokens/s over all sessions is reported for the batched engine and for the same engine
with max_batch_sessions=1 (one session's step per forward), run back to back on the same
noisy machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch

from tests.prompts import CHAT_PROMPTS, CODE_PROMPTS, REPETITIVE_PROMPTS
from pardec.bench.decode import Decode, InProcess
from pardec.verifier.loading import load_model
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.costcurve import measure_cost_curve
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.quant import choose_kernel
from pardec.verifier.model.weights import load_checkpoint

PROMPTS = [*CODE_PROMPTS, *CHAT_PROMPTS, *REPETITIVE_PROMPTS]


def ngram_draft(history: list[int], size: int = 16) -> tuple[list[int], list[int]]:
    """What followed the last two earlier occurrences of the last token, as chains under the root."""
    tokens, parents = [], []
    for start in [i + 1 for i in range(len(history) - 1) if history[i] == history[-1]][-2:]:
        for depth, token in enumerate(history[start : start + size // 2]):
            parents.append(-1 if depth == 0 else len(tokens) - 1)
            tokens.append(token)
    return tokens, parents


class NgramDrafter:
    """The decode loop's drafter (bench/decode.py) of the "ngram" style: `ngram_draft` over the
    prompt and every token made so far."""

    def start(self, prompt_ids):
        self.history = list(prompt_ids)

    def propose(self, new_tokens, node_argmax, max_depth):
        self.history += new_tokens
        return ngram_draft(self.history)

    def observe(self, verified, nodes):
        pass

    def end(self, last_tokens):
        pass


def run_sessions(engine: Engine, prompts: list[list[int]], new_tokens: int, style: str) -> tuple[float, int]:
    """(decode tokens/s over all sessions, forwards used while decoding)."""
    count = len(prompts)
    barrier = threading.Barrier(count + 1)
    done = threading.Barrier(count + 1)
    produced = [0] * count

    def client(i):
        # new_tokens after the prefill's, each step's counted whole: no stop token ends a session.
        session = Decode(InProcess(engine), f"bench-{i}-{random.random()}", prompts[i], new_tokens + 1,
                         drafter=NgramDrafter() if style == "ngram" else None)
        session.prefill()
        barrier.wait()
        produced[i] = session.run().produced
        done.wait()
        session.release()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    barrier.wait()
    forwards, start = engine.stats.forwards, time.perf_counter()
    done.wait()
    elapsed = time.perf_counter() - start
    forwards = engine.stats.forwards - forwards
    for thread in threads:
        thread.join()
    return sum(produced) / elapsed, forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--style", choices=["plain", "ngram"], default="plain")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-wait-ms", type=float, default=2.0)
    parser.add_argument("--cost-curve", action="store_true", help="also print step ms by tree size x batch 1/4/16")
    parser.add_argument("--prefill", type=int, default=0, help="also time a prompt of this many tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(None)
    model = load_model(checkpoint, "w8a8", kernel=choose_kernel("cpu"))
    print(f"kernel {model.kernel}, {args.threads} threads, style {args.style}, {args.new_tokens} new tokens per session")

    def engine(**overrides) -> Engine:
        config = VerifierConfig(measure_cost_curve=False, **overrides)
        return Engine(model, checkpoint.tokenizer, checkpoint.model_name, config)

    encoded = [checkpoint.tokenizer.encode_chat(p) for p in PROMPTS]
    warm = engine()  # the first forwards of a process pay one-time costs (allocator, BLAS setup)
    run_sessions(warm, encoded[:2], 8, args.style)
    warm.close()
    modes = {"batched": dict(batch_wait_ms=args.batch_wait_ms),
             "unbatched": dict(max_batch_sessions=1, batch_wait_ms=0.0, max_batch_tokens=4096)}
    results = {(mode, n): [] for mode in modes for n in args.sessions}
    forwards = {}
    for _ in range(args.rounds):
        for n in args.sessions:
            prompts = [encoded[i % len(encoded)] for i in range(n)]
            for mode, overrides in modes.items():
                eng = engine(**overrides)
                rate, forwards[mode, n] = run_sessions(eng, prompts, args.new_tokens, args.style)
                eng.close()
                results[mode, n].append(rate)
    print("\n| sessions | unbatched tok/s | batched tok/s | speedup | forwards unbatched / batched |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.sessions:
        plain, batched = (statistics.median(results[m, n]) for m in ("unbatched", "batched"))
        print(f"| {n} | {plain:.1f} | {batched:.1f} | {batched / plain:.2f}x | "
              f"{forwards['unbatched', n]} / {forwards['batched', n]} |")

    if args.cost_curve:
        eng = engine()
        curve = eng.call(lambda: measure_cost_curve(model, eng.pool, batches=(1, 4, 16)))
        eng.close()
        by = {(t, b): ms for t, b, ms in curve}
        tokens = sorted({t for t, _, _ in curve})
        print("\n| step ms (context 256 per session) | " + " | ".join(f"{t} tok" for t in tokens) + " |")
        print("|---" * (len(tokens) + 1) + "|")
        for b in (1, 4, 16):
            print(f"| batch {b} | " + " | ".join(f"{by[t, b]:.1f}" for t in tokens) + " |")

    if args.prefill:
        prompt = [random.Random(0).randrange(3, 49152) for _ in range(args.prefill)]
        eng = engine(max_input_tokens=max(args.prefill, 2048), max_seq_len=max(args.prefill, 2048) + 512)
        start = time.perf_counter()
        eng.prefill("prefill", prompt, Sampling(), None)
        chunked = time.perf_counter() - start
        eng.close()
        cache = KVCache(checkpoint.args, args.prefill)
        start = time.perf_counter()
        model(torch.tensor(prompt), torch.arange(args.prefill), torch.ones(args.prefill, args.prefill).tril().bool(),
              cache, output_rows=torch.tensor([args.prefill - 1]))
        whole = time.perf_counter() - start
        print(f"\nprefill {args.prefill} tokens: engine (chunks of {VerifierConfig().max_batch_tokens}) "
              f"{chunked * 1e3:.0f} ms, one forward {whole * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
