"""Drafter latency and memory: propose p50/p99, session start, Redis bytes per session.

    python -m pardec.bench.drafter_latency [--steps 300] [--contexts 512 2048 8192] [--grpc]

For each context length and algorithm (memory_decoding with 16 nodes, the same with
dynamic_algo, lookahead N=4 W=5 G=5 with 30-node budgets and the largest, 16/16/16 with
480), starts a session on a prompt of that
many tokens, then runs `--steps` proposes that commit 1-4 tokens each (lookahead also gets an
argmax of the previous tree's size). Times are wall-clock at the caller: the SessionStore call
(Python + one Redis round trip), or with --grpc a Propose through a real drafter server on
loopback; "Redis us/propose" is Redis's own time per script call (its commandstats), what
bounds the proposes one Redis serves a second. While the session starts, another session proposes
in a loop (SessionStore, 16 nodes): "others wait" is the longest of those proposes, i.e. how long
the start held Redis from everybody else. "Redis ms/start" is Redis's own time for a second start
of the same prompt, alone. Memory is Redis's MEMORY USAGE summed over the session's keys after the
steps. Prints a Markdown table. Redis is a private redis-server on a unix socket.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc
import redis

from pardec.bench.stack import launch
from pardec.drafter.sessions import SessionStore
from pardec.runtime.draft_params import DraftParams
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import drafter_pb2, drafter_pb2_grpc

VOCAB = 49152
ALGORITHMS = {
    "memory_decoding": (DraftParams(decoding_length=16), 16),
    "md dynamic_algo": (DraftParams(decoding_length=16, dynamic_algo=True), 16),
    "lookahead 4/5/5": (DraftParams("la", level=4, window=5, guess_set_size=5), 30),
    "lookahead 16/16/16": (DraftParams("la", level=16, window=16, guess_set_size=16), 480),
}


def synthetic_text(length: int, seed: int) -> list[int]:
    """Zipf-like token frequencies with copied spans, roughly like code and chat: a quarter of
    the text repeats earlier stretches, so tries and pools grow real branches."""
    rng = random.Random(seed)
    text: list[int] = []
    while len(text) < length:
        if len(text) > 64 and rng.random() < 0.25:
            start = rng.randrange(len(text) - 32)
            text += text[start : start + rng.randint(4, 32)]
        else:
            text.append(min(int(rng.paretovariate(0.8)), VOCAB - 1))
    return text[:length]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def session_bytes(client: redis.Redis, session: str) -> int:
    return sum(client.memory_usage(key, samples=0) or 0 for key in client.keys(f"*{{{session}}}*"))


def longest_wait_of_others(store: SessionStore, action) -> float:
    """Runs `action` while another session proposes in a loop; the longest propose, in ms."""
    other = f"bench-other-{uuid.uuid4().hex}"
    store.start_session(other, synthetic_text(256, 99), DraftParams())
    done, waits = threading.Event(), []

    def propose_loop():
        while not done.is_set():
            clock = time.perf_counter()
            store.propose(other, [], [], 16, 64)
            waits.append((time.perf_counter() - clock) * 1e3)

    thread = threading.Thread(target=propose_loop)
    thread.start()
    try:
        action()
    finally:
        done.set()
        thread.join()
        store.end_session(other)
    return max(waits, default=0.0)


def measure(client, store, propose_call, start_call, settings, budget, context, steps, seed):
    text = synthetic_text(context + steps * 4 + 8, seed)
    session = f"bench-{uuid.uuid4().hex}"
    clock = time.perf_counter()
    others_wait_ms = longest_wait_of_others(store, lambda: start_call(session, text[:context], settings))
    start_ms = (time.perf_counter() - clock) * 1e3
    client.config_resetstat()
    start_call(f"{session}-alone", text[:context], settings)
    start_redis_ms = client.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0) / 1e3
    store.end_session(f"{session}-alone")
    rng, position, argmax, times = random.Random(seed), context, [], []
    client.config_resetstat()
    for _ in range(steps):
        take = rng.randint(1, 4)
        new_tokens = text[position : position + take]
        position += take
        clock = time.perf_counter()
        nodes = propose_call(session, new_tokens, argmax, budget, 64)
        times.append((time.perf_counter() - clock) * 1e3)
        argmax = [text[(position + i) % len(text)] for i in range(nodes + 1)]
    # Redis's own time per script call: what bounds how many proposes one Redis serves a second.
    redis_us = client.info("commandstats").get("cmdstat_evalsha", {}).get("usec_per_call", 0.0)
    memory = session_bytes(client, session)
    return start_ms, start_redis_ms, others_wait_ms, times, redis_us, memory, session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--grpc", action="store_true", help="time Propose through a gRPC drafter server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdb-", dir="/tmp") as workdir, \
            launch(Path(workdir), drafter_in_process=args.grpc) as local:
        client = redis.Redis.from_url(local.redis_url)
        store = SessionStore(client)
        if args.grpc:
            stub = drafter_pb2_grpc.DrafterStub(grpc.insecure_channel(local.drafter_address, options=CHANNEL_OPTIONS))

            def start_call(session, prompt, settings):
                config = drafter_pb2.DraftConfig(
                    plugin_type=settings.plugin_type, decoding_length=settings.decoding_length,
                    dynamic_algo=settings.dynamic_algo, level=settings.lookahead.level,
                    window=settings.lookahead.window, guess_set_size=settings.lookahead.guess_set_size,
                )  # fmt: skip
                request = drafter_pb2.StartSessionRequest(session_id=session, prompt_token_ids=prompt, config=config)
                stub.StartSession(request)

            def propose_call(session, new_tokens, argmax, max_nodes, max_depth):
                request = drafter_pb2.ProposeRequest(
                    session_id=session, new_token_ids=new_tokens, max_nodes=max_nodes, max_depth=max_depth,
                    last_node_argmax=argmax,
                )  # fmt: skip
                return len(stub.Propose(request).tree.token_ids)
        else:
            start_call = store.start_session

            def propose_call(session, new_tokens, argmax, max_nodes, max_depth):
                return len(store.propose(session, new_tokens, argmax, max_nodes, max_depth)[0])

        print(
            "| algorithm | context | start ms | Redis ms/start | others wait ms | propose p50 ms | p99 ms "
            "| Redis us/propose | Redis KB/session | bytes/token |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for context in args.contexts:
            for seed, (name, (settings, budget)) in enumerate(ALGORITHMS.items()):
                start_ms, start_redis_ms, others_wait_ms, times, redis_us, memory, session = measure(
                    client, store, propose_call, start_call, settings, budget, context, args.steps, seed
                )
                store.end_session(session)
                print(
                    f"| {name} | {context} | {start_ms:.1f} | {start_redis_ms:.1f} | {others_wait_ms:.1f} | {statistics.median(times):.3f} | "
                    f"{percentile(times, 0.99):.3f} | {redis_us:.0f} | {memory / 1024:.0f} | {memory / context:.0f} |"
                )


if __name__ == "__main__":
    main()
