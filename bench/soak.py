"""Soak: the real process stack (2 verifier replicas, 2 drafters, Redis, a gateway that requires
tokens) under mixed load for a long time while its processes are killed, restarted and paused.

--in-flight clients send all the time, --in-flight-max every other --phase-s: streams, unary, plain
and conversation calls, calls with a prediction (the plain answer with an edit), calls with short
deadlines, cancels, malformed and oversized messages, wrong tokens. Every --fault-every-s one fault
in turn: SIGKILL a drafter or a verifier replica (started again on its port --down-s later),
restart Redis, SIGSTOP a drafter or Redis for --pause-s. Kills and restarts happen in the first
half only, so that the second half measures the RSS of processes that are not replaced. Every completed output must be plain decoding's (made before the load), a
cut one a prefix of it. Writes soak.json and soak.md (outcomes by kind and status, p50/p99, faults,
sessions and Redis keys left, RSS growth per process) to --out; exit code 0 when it passed.

    python -m pardec.bench.soak --minutes 30 --in-flight 16 --out bench/out/soak
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import redis

from pardec.bench import workloads as workload_data
from pardec.bench.load import _pct, _round, redis_keys
from pardec.bench.soak_report import markdown, rss_growth
from pardec.bench.stack import MODES, mindie_config
from pardec.gateway.mindie import load_mindie_config
from pardec.gateway.stack import Stack
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pardec.verifier.config import KV_CACHE_DTYPES

OK = "OK"
GENERATE, STREAM = "/pardec.v1.Gateway/Generate", "/pardec.v1.Gateway/GenerateStream"
TOKENS = {"soak-token-of-tenant-a-0123456789": "soak-a", "soak-token-of-tenant-b-9876543210": "soak-b"}
# Request kinds, their weights in the mix, and the statuses each may end with. Normal requests
# must always succeed, whatever fault is in progress; refused kinds must never.
KINDS = {"unary": (20, {OK}), "stream": (20, {OK}), "plain": (8, {OK}), "conversation": (8, {OK}), "predicted": (6, {OK}),
         "deadline": (8, {OK, "DEADLINE_EXCEEDED"}), "stream_deadline": (6, {OK, "DEADLINE_EXCEEDED"}),
         "cancel": (8, {OK, "CANCELLED"}), "unary_cancel": (6, {OK, "CANCELLED"}),
         "malformed": (6, {"INVALID_ARGUMENT"}), "oversized": (3, {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}),
         "wrong_token": (7, {"UNAUTHENTICATED"})}
REFUSED = ("malformed", "oversized", "wrong_token")
MALFORMED = [b"\x0a\xff", b"\x0a\x02\xff\xfe", b"\x10\x01"] + [gateway_pb2.GenerateRequest(
    **{"prompt": "hi", "max_new_tokens": 4, **fields}).SerializeToString() for fields in (
    {"n": 2}, {"decoding": 7}, {"session_id": "a b"}, {"max_new_tokens": 10**7}, {"stop": ["x"] * 17},
    {"sampling": common_pb2.SamplingParams(temperature=math.nan)}, {"logprobs": True})]
OVERSIZED = [gateway_pb2.GenerateRequest(prompt="x" * (1 << 20)).SerializeToString(),
             gateway_pb2.GenerateRequest(prompt="many words " * 4000, max_new_tokens=4).SerializeToString()]
WRONG_AUTH = [(), (("authorization", "Bearer soak-token-nobody-has-000000000"),),
              (("authorization", "Basic c29hazpzb2Fr"),), (("authorization", "Bearer"),)]
# A key pattern of a conversation's or the shared drafting memory (TTL'd by design), not of a session.
memory = re.compile(r"\{(conversation|shared):").search
CHAT = ("What are three good habits for staying healthy?", "Explain in two sentences why the sky is blue.",
        "Repeat exactly, one per line: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.")
KILLS = ("kill_drafter", "pause_drafter", "restart_redis", "pause_redis", "kill_verifier")
PAUSES = ("pause_drafter", "pause_redis")


class SoakStack(Stack):
    """`Stack` with verifier metrics (live sessions), whose services restart where the gateway expects them."""

    def _spawn(self, name, flags, module=None):
        self.__dict__.setdefault("flags", {})[name] = (list(flags), module)
        if module == "verifier":
            flags = [*flags, "--metrics-addr", "127.0.0.1:0", "--metrics-ready-file", str(self.metrics_file(name))]
        super()._spawn(name, flags, module)

    def metrics_file(self, name: str) -> Path:  # a verifier's metrics address, once it serves them
        return self.workdir / f"{name}-metrics.addr"

    def restart(self, name: str) -> None:
        flags, module = self.flags[name]
        flags = [self.addresses[name] if i and flags[i - 1] == "--addr" else f for i, f in enumerate(flags)]
        self._spawn(name, flags, module)
        self._wait_ready([name])

    def live_sessions(self) -> dict[str, float | None]:
        """The gateway's requests running and each verifier's sessions (or why its metrics did not answer)."""
        live = {"gateway": scrape(self.addresses["gateway-metrics"]).get("pardec_requests_running")}
        for name in self.verifier_names:
            file = self.metrics_file(name)
            metrics = scrape(file.read_text().strip()) if file.exists() else {"error": "no metrics address"}
            live[name] = metrics.get("pardec_verifier_sessions", metrics.get("error"))
        return live


    def pool_mib(self, name: str) -> float | None:
        """A verifier's KV pool pages ever handed out (its metrics), None when they do not answer."""
        file = self.metrics_file(name)
        touched = scrape(file.read_text().strip()).get("pardec_verifier_kv_pool_touched_bytes") if file.exists() else None
        return None if touched is None else touched / 2**20


def scrape(address: str) -> dict[str, float]:
    try:
        page = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    except OSError as error:  # the reason stands in for the metrics
        return {"error": repr(error)[:200]}
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
            for line in page.splitlines() if line and not line.startswith("#")}


class Soak:
    def __init__(self, args, stack: SoakStack, prompts: list[str]):
        self.args, self.stack, self.prompts = args, stack, prompts
        self.sizes = [int(n) for n in str(args.max_new_tokens).split(",")]
        self.auth = [(("authorization", f"Bearer {token}"),) for token in TOKENS]
        self.channels = [grpc.insecure_channel(stack.gateway_address, options=CHANNEL_OPTIONS) for _ in range(4)]
        # rss: {"t": s, name: [pid, MiB], verifier: [pid, MiB, KV pool MiB]}
        self.references, self.texts, self.outcomes, self.faults, self.rss = {}, {}, [], [], []
        self.done, self.start = threading.Event(), time.monotonic()
        # Restarts run on this pool's long-lived thread: PR_SET_PDEATHSIG fires when the spawning *thread* exits.
        self.spawner = ThreadPoolExecutor(1, thread_name_prefix="soak-spawner")

    def now(self) -> float:  # seconds since the stack served
        return round(time.monotonic() - self.start, 2)

    def request(self, case: tuple[int, int], kind: str, worker: int) -> gateway_pb2.GenerateRequest:
        plain = gateway_pb2.DECODING_MODE_PLAIN if kind == "plain" else gateway_pb2.DECODING_MODE_DEFAULT
        # A prediction: the plain answer with its middle third left out (an edit to follow past).
        text = self.texts.get(case, "")
        predicted = text[: len(text) // 3] + text[2 * len(text) // 3 :] if kind == "predicted" else ""
        return gateway_pb2.GenerateRequest(prompt=self.prompts[case[0]], max_new_tokens=case[1], decoding=plain,
                                           session_id=f"soak-{worker}" if kind == "conversation" else "",
                                           prediction=predicted)

    def one(self, kind: str, worker: int, rng: random.Random) -> dict:
        channel = self.channels[worker % len(self.channels)]
        stub, auth = gateway_pb2_grpc.GatewayStub(channel), rng.choice(self.auth)
        case = (rng.randrange(len(self.prompts)), rng.choice(self.sizes))
        request = self.request(case, kind, worker)
        timeout = rng.uniform(0.2, 3.0) if kind.endswith("deadline") else self.args.request_timeout_s
        tokens, cut, code, detail, began = None, False, OK, "", time.monotonic()
        try:
            if kind in REFUSED:  # raw bytes, as a hostile caller sends them, unary or streamed
                body = {"malformed": MALFORMED, "oversized": OVERSIZED}.get(kind, [request.SerializeToString()])
                body = rng.choice(body)
                method = channel.unary_unary(GENERATE) if rng.random() < 0.5 else channel.unary_stream(STREAM)
                list(method(body, timeout=60, metadata=rng.choice(WRONG_AUTH) if kind == "wrong_token" else auth))
            elif kind == "unary_cancel":
                future = stub.Generate.future(request, timeout=timeout, metadata=auth)
                time.sleep(rng.uniform(0.05, 2.0))
                future.cancel()
                try:
                    tokens = list(future.result().token_ids)
                except grpc.FutureCancelledError:
                    code = "CANCELLED"
            elif kind in ("stream", "cancel", "stream_deadline"):
                tokens, cut, call = [], True, stub.GenerateStream(request, timeout=timeout, metadata=auth)
                stop_after = rng.randint(1, 6) if kind == "cancel" else 0
                for count, chunk in enumerate(call, start=1):
                    tokens += chunk.token_ids
                    if count == stop_after:
                        call.cancel()
                cut = False
            else:
                tokens = list(stub.Generate(request, timeout=timeout, metadata=auth).token_ids)
        except grpc.RpcError as error:
            code, detail = error.code().name, (error.details() or "")[:300]
        ended = time.monotonic()
        return {"kind": kind, "t": round(began - self.start, 2), "latency_ms": round((ended - began) * 1e3, 1),
                "status": code, "case": list(case), "check": self.check(case, tokens, cut or code != OK),
                "expected": self.expected(kind, code), "detail": detail,
                "faults": self.faults_between(began - self.start, ended - self.start)}

    def check(self, case, tokens, cut) -> str:  # identical, prefix (a cut output), mismatch; "": nothing came back
        reference = self.references[tuple(case)]
        if tokens and cut:
            return "prefix" if tokens == reference[:len(tokens)] else "mismatch"
        return "" if cut or tokens is None else ("identical" if tokens == reference else "mismatch")

    @staticmethod
    def expected(kind: str, code: str) -> bool:
        return code in KINDS[kind][1]

    def faults_between(self, t0: float, t1: float, grace_s: float = 10.0) -> list[str]:
        return [f"{f['fault']} {f['target']}@{f['start_s']}" for f in list(self.faults)
                if f["start_s"] <= t1 and (f.get("end_s") is None or f["end_s"] + grace_s >= t0)]

    def worker(self, index: int, until: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while time.monotonic() < until:
            if index >= self.args.in_flight and int((time.monotonic() - self.load_start) / self.args.phase_s) % 2 == 0:
                time.sleep(0.5)  # a quiet phase: only --in-flight clients send
                continue
            self.outcomes.append(self.one(rng.choices(list(KINDS), [w for w, _ in KINDS.values()])[0], index, rng))

    def sample_rss(self) -> None:
        while not self.done.wait(self.args.rss_interval_s):
            sample = {"t": self.now()}
            for name, pid in self.stack.pids().items():
                with contextlib.suppress(OSError, AttributeError):  # it may just have died
                    status = Path(f"/proc/{pid}/status").read_text()
                    sample[name] = [pid, int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024]
                    if name in self.stack.verifier_names and (pool := self.stack.pool_mib(name)) is not None:
                        sample[name].append(pool)
            self.rss.append(sample)

    def inject(self, kind: str, turn: int) -> None:
        stack, args = self.stack, self.args
        target = {"kill_drafter": f"drafter-{turn % 2}", "pause_drafter": f"drafter-{(turn + 1) % 2}",
                  "kill_verifier": stack.verifier_names[turn % 2]}.get(kind, "redis")
        self.faults.append(record := {"fault": kind, "target": target, "start_s": self.now(), "end_s": None})
        log(f"t={record['start_s']:.0f}s {kind} {target}")
        if kind == "restart_redis":  # on the spawner's thread too: Redis dies with the thread that started it
            self.spawner.submit(stack.redis.restart).result()
        elif kind.startswith("pause"):
            os.kill(pid := stack.pids()[target], signal.SIGSTOP)
            try:
                time.sleep(args.pause_s)
            finally:
                os.kill(pid, signal.SIGCONT)
        else:
            (victim := stack.process(target)).send_signal(signal.SIGKILL)
            victim.wait(30)
            time.sleep(args.down_s)
            self.spawner.submit(stack.restart, target).result()
        record["end_s"] = self.now()
        log(f"t={record['end_s']:.0f}s {target} back")

    def inject_all(self, until: float) -> None:
        load_s, turn = until - self.load_start, 0
        at = self.load_start + self.args.first_fault_s
        while at < until - self.args.pause_s - 5:  # a fault ends before the load does (a restart may not)
            time.sleep(max(0.0, at - time.monotonic()))
            rotation = KILLS if at - self.load_start < load_s / 2 else PAUSES
            self.inject(rotation[turn % len(rotation)], turn // len(rotation))
            turn, at = turn + 1, max(at + self.args.fault_every_s, time.monotonic() + 1)

    def run(self) -> dict:
        log(f"plain references: {len(self.prompts)} prompts x {self.sizes} new tokens")
        stub = gateway_pb2_grpc.GatewayStub(self.channels[0])
        for case in ((index, size) for index in range(len(self.prompts)) for size in self.sizes):
            reference = stub.Generate(self.request(case, "plain", 0), timeout=600, metadata=self.auth[0])
            self.references[case], self.texts[case] = list(reference.token_ids), reference.text
        self.load_start = time.monotonic()
        until = self.load_start + self.args.minutes * 60
        threads = [threading.Thread(target=target, args=args, daemon=True) for target, args in (
            (self.sample_rss, ()), (self.inject_all, (until,)),
            *((self.worker, (i, until)) for i in range(max(self.args.in_flight, self.args.in_flight_max))))]
        [thread.start() for thread in threads]
        log(f"load for {self.args.minutes} min with {self.args.in_flight}-{self.args.in_flight_max} in flight")
        [thread.join() for thread in threads[2:]]
        load_end = self.now()
        threads[1].join()
        settled_s, live = self.settle()
        self.done.set()  # the RSS sampler's
        return summarize(self, load_end, settled_s, live, redis_keys(redis.Redis.from_url(self.stack.redis_url)),
                         scrape(self.stack.addresses["gateway-metrics"]))

    def settle(self) -> tuple[float | None, dict]:
        """Seconds until no request runs, no verifier holds a session, Redis holds no session key; None: never."""
        began, client = time.monotonic(), redis.Redis.from_url(self.stack.redis_url)
        while True:
            live = self.stack.live_sessions()
            live["redis session keys"] = sum(r["count"] for r in redis_keys(client) if not memory(r["pattern"]))
            settled = not any(v is None or v for v in live.values())  # None: a verifier did not answer
            if settled or time.monotonic() - began > self.args.settle_s:
                return (round(time.monotonic() - began, 1) if settled else None), live
            time.sleep(0.5)


def summarize(soak: Soak, load_end: float, settled_s, live: dict, keys: list[dict], gateway: dict) -> dict:
    args, outcomes = soak.args, soak.outcomes
    load_start = round(soak.load_start - soak.start, 2)
    kinds = {}
    for kind in KINDS:
        rows = [o for o in outcomes if o["kind"] == kind]
        latencies = [o["latency_ms"] for o in rows]
        kinds[kind] = {"requests": len(rows), "statuses": dict(Counter(o["status"] for o in rows).most_common()),
                       "unexpected": sum(not o["expected"] for o in rows),
                       **{c: sum(o["check"] == c for o in rows) for c in ("identical", "prefix", "mismatch")},
                       "p50_ms": _round(_pct(latencies, 50)), "p99_ms": _round(_pct(latencies, 99))}
    rss = rss_growth(soak.rss, load_start + (load_end - load_start) / 2)
    left = {"sessions": live, "keys_without_ttl": sum(r["without_ttl"] for r in keys),
            "session_keys": sum(r["count"] for r in keys if not memory(r["pattern"])),
            "memory_keys": sum(r["count"] for r in keys if memory(r["pattern"]))}
    growth = [r["judged_mib_per_min"] or 0 for r in rss.values()]
    verdict = {  # the "done when"
        "no unexpected outcome": sum(k["unexpected"] for k in kinds.values()) == 0,
        "every completed output identical to plain": sum(k["mismatch"] for k in kinds.values()) == 0,
        "no session left": settled_s is not None and left["session_keys"] == 0,
        "no Redis key without a TTL": left["keys_without_ttl"] == 0,
        f"RSS growth under {args.rss_limit_mib_per_min} MiB/min (verifiers: net of their KV pool's pages)":
            all(g < args.rss_limit_mib_per_min for g in growth),
    }
    counters = {name: value for name, value in gateway.items() if name.startswith((
        "pardec_verifier_failovers_total{", "pardec_drafter_fallbacks_total{", "pardec_spec_decode_num_accepted_tokens_total"))}
    return {"config": vars(args), "date": datetime.date.today().isoformat(), "prompts": len(soak.prompts),
            "load_s": round(load_end - load_start, 1), "requests": len(outcomes), "kinds": kinds,
            "passed": all(verdict.values()), "verdict": verdict, "faults": soak.faults, "settled_s": settled_s,
            "left": left, "redis_keys": keys, "rss": rss, "gateway_counters": counters,
            "unexpected": [o for o in outcomes if not o["expected"] or o["check"] == "mismatch"],
            "outcomes": outcomes, "rss_samples": soak.rss}


# Flags: name, default (its type is the flag's), help.
FLAGS = (("minutes", 30.0, "time under load"), ("in-flight", 16, ""), ("in-flight-max", 32, "in every other phase"),
         ("phase-s", 60.0, ""), ("max-new-tokens", "32,64", "drawn per request"), ("prompts", 4, "per workload"),
         ("workloads", "code_edit", "beside 3 chat prompts"), ("fault-every-s", 60.0, ""), ("first-fault-s", 60.0, ""),
         ("pause-s", 5.0, "SIGSTOP's length"), ("down-s", 10.0, "a killed process's time down"),
         ("request-timeout-s", 300.0, "normal requests' deadline"), ("settle-s", 60.0, "longest wait for sessions "
          "to end after the load"), ("rss-interval-s", 5.0, ""), ("rss-limit-mib-per-min", 1.0, ""), ("seed", 0, ""),
         ("out", "bench/out/soak", ""))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pardec.bench.soak", description=__doc__.splitlines()[0])
    for name, default, text in FLAGS:
        parser.add_argument(f"--{name}", type=type(default), default=default, help=text or None)
    parser.add_argument("--mode", default="md16", choices=sorted(MODES), help="the server's parallel decoding")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="the verifiers' KV cache")
    return parser.parse_args(argv)


def soak(args: argparse.Namespace, prompts: list[str]) -> dict:
    """Starts the stack, runs the soak, writes soak.json and soak.md to ``args.out``; the result."""
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        config, tokens = Path(tmp) / "config.json", Path(tmp) / "tokens.json"
        config.write_text(json.dumps(mindie_config(MODES[args.mode])))
        tokens.touch(0o600)
        tokens.write_text(json.dumps(TOKENS))
        stack = SoakStack(Path(tmp) / "stack", load_mindie_config(str(config)), gateway_addr="127.0.0.1:0",
                          drafters=2, verifiers=2, config_path=str(config), metrics_addr="127.0.0.1:0",
                          log_level="WARNING", tokens_file=str(tokens),
                          verifier_flags=("--kv-cache-dtype", args.kv_cache_dtype))
        log("starting the stack: Redis, 2 verifiers, 2 drafters, the gateway")
        try:
            result = Soak(args, stack.start(), prompts).run()
        finally:
            stack.stop()
    (out := Path(args.out)).mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    (out / "soak.md").write_text(markdown(result))
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = [*CHAT, *(p for w in args.workloads.split(",") if w for p in workload_data.load(w, args.prompts))]
    result = soak(args, prompts)
    print(markdown(result))
    return 0 if result["passed"] else 1


def log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
