"""The gateway's tree sizing replayed on the real model and drafter, on a clock it sets itself.

    python -m pardec.bench.sizing_replay --workloads retrieval,mtbench --modes md16,la-4-5-5 \
        [--prompts 3] [--max-new-tokens 128] [--set prior_mass=0.5 ...]

A bench through the stack compares wall clocks, and on a shared 2-core machine two runs of
identical work differ by up to ±15% (the A/A control), more than most policy changes move.
Here every step is real (a real drafter over gRPC and Redis, the real verifier, the gateway's
own `DraftSession` deciding each tree, outputs checked against plain decoding), but each step
is charged a modelled time: the step's fixed cost, the forward from a cost curve, and the
drafter's round trip when it was asked:

    step_ms = overhead_ms + forward_ms(tree nodes + 1) + (drafter_ms if asked else 0)

so the same policy always reads the same figure, and two policies' ratios differ only by
what they decide. The defaults are what a Zen 3 2-core CPU measured (a verifier step-cost table since
superseded; git history of README.md has it): forwards of 1/4/8/16/32/64 tokens at 9.4/13.8/20.4/
33.3/60.9/116.7 ms, a plain step 2.8 ms beyond its forward through the stack, the drafter's
call 2.2 ms as the gateway sees it. The policy sizes trees from the same curve (the verifier
publishes its own at startup; here it would add its measurement noise to the comparison).

A probe (the drafter asked beside a plain step while trees do not pay) is charged `probe_ms`:
it runs while the verifier computes, but on a 2-core machine it takes CPU from the forward. The
Zen 3 measured, side by side over 40-step runs of the retrieval prompts, a plain step at 14.3 ms,
with a Propose beside it 17.3 ms, after a Propose 18.4 ms: a probe costs ~0.74 of a round trip.

A mode with `+overlap` drafts ahead (gateway/draft_ahead.py): a step whose tree came from the
tree drafted while the previous step verified waits for no call, and its ahead call runs beside
the forward: such a step is charged the longer of the step and the drafter's round trip, plus
`ahead_ms` (0 where the verifier runs on an accelerator and the host's cores are idle; on a CPU
it takes cores from the forward). `--forward-ms` replaces the forward's cost curve (the
verifier's step at 1, 16 and 64 tokens, say, on a GPU), so the same replay models another device.

`--set name=value` overrides a field of the gateway's LoadPolicy, to compare policies.
`--shared-memory N` also replays each mode with a drafting memory shared across its requests
(GatewayConfig.shared_memory), first warmed on N prompts of the workload that are not measured;
each measured request then feeds it too, as on a server.
Concurrency is 1: the load governor and batching are out of scope.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from pardec.bench import workloads
from pardec.bench.decode import OverGrpc, decode
from pardec.bench.stack import MODES, OVERLAP, launch, split_mode
from pardec.gateway.clients import DrafterClient, VerifierClient
from pardec.verifier.api import Verification
from pardec.runtime.draft_params import DraftParams
from pardec.gateway.config import GatewayConfig, LoadPolicy
from pardec.gateway.drafting import DraftSession
from pardec.gateway.tree_sizing import CostCurve

FORWARD_MS = ((1, 1, 9.4), (4, 1, 13.8), (8, 1, 20.4), (16, 1, 33.3), (32, 1, 60.9), (64, 1, 116.7))


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """The modelled clock: what a step costs besides the forward, the forward, the drafter."""

    overhead_ms: float
    drafter_ms: float
    probe_ms: float  # what a Propose beside the step slows it by (CPUs shared with the verifier)
    forward: CostCurve
    ahead_ms: float = 0.0  # what an ahead call beside the step slows it by

    def step_ms(self, nodes: int, asked: bool, probed: bool = False, ahead: bool = False) -> float:
        step = self.overhead_ms + self.forward.step_ms(nodes + 1, 1)
        if ahead:  # the next tree is drafted during this step: the later of the two ends it
            return max(step, self.drafter_ms) + self.ahead_ms
        return step + (self.drafter_ms if asked else 0.0) + (self.probe_ms if probed else 0.0)


class ModelledDrafter:
    """The real drafter client whose Propose calls take the modelled round trip on `clock`;
    a probe (a Propose beside a plain step) is awaited at once, so that its verdict never
    depends on how fast this machine answered."""

    def __init__(self, client: DrafterClient, drafter_ms: float):
        self._client, self._drafter_s, self.now_s = client, drafter_ms / 1e3, 0.0
        self.calls = self.probes = 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def propose(self, *args, **kwargs):
        self.calls += 1
        self.now_s += self._drafter_s
        return self._client.propose(*args, **kwargs)

    def propose_future(self, *args, **kwargs):
        self.probes += 1
        future = self._client.propose_future(*args, **kwargs)
        future.exception()
        return future

    def clock(self) -> float:
        return self.now_s


class ReplayClock:
    """The decode loop's drafter (bench/decode.py) for one replayed request: the gateway's own
    `DraftSession` when `params` drafts (None: plain), and every step charged its modelled time."""

    def __init__(self, drafter, config, params, costs: StepCosts, session_id, trace=None, shared_memory="",
                 overlap=False):
        self.timed, self.costs = ModelledDrafter(drafter, costs.drafter_ms), costs
        self.trace, self.shared_memory = trace, shared_memory
        self.drafts = params and DraftSession(self.timed, session_id, params, config, cost=costs.forward,
                                              clock=self.timed.clock, overlap=overlap)
        self.total_ms, self._asked, self._ahead, self.ahead_steps = 0.0, (0, 0), False, 0

    def start(self, prompt_ids):
        if self.drafts:
            self.drafts.start(prompt_ids, shared_memory=self.shared_memory)

    def propose(self, new_tokens, node_argmax, max_depth):
        self._asked = self.timed.calls, self.timed.probes
        if not self.drafts:
            return [], []
        tree = self.drafts.propose(new_tokens, 1, max_depth, node_argmax)
        self._ahead = self.drafts._ahead_call is not None  # sent by this step: its tree was drafted ahead
        return tree

    def observe(self, verified, nodes):
        forward_ms = self.costs.forward.step_ms(nodes + 1, 1)
        if self.drafts:
            modelled = Verification(verified.accepted_tokens, verified.bonus_token, verified.node_argmax, forward_ms)
            self.drafts.costs.observe(modelled, nodes, self.costs.overhead_ms + forward_ms, 1)
        asked, probed = self.timed.calls > self._asked[0], self.timed.probes > self._asked[1]
        ahead = self._ahead and not asked
        self.ahead_steps += ahead
        self.total_ms += self.costs.step_ms(nodes, asked, probed and not ahead, ahead)
        if self.trace is not None:
            step = f"{nodes}:{len(verified.accepted_tokens)}"
            self.trace.append(step if asked else "a" + step if ahead else "p" if probed else "-")

    def end(self, last_tokens):
        if self.drafts:
            self.drafts.end(last_tokens)


def replay(verifier, drafter, config, params, prompt_ids, max_new, stop_ids, costs, session_id, trace=None,
           shared_memory="", overlap=False):
    """(output tokens, steps, modelled ms, accepted draft tokens, steps whose tree was drafted
    ahead): one request, greedy, plain when `params` is None. `trace` gets each step's
    "nodes:accepted" ("-" when the drafter was not asked, "p" for a probe, "a" before a tree
    drafted ahead)."""
    clock = ReplayClock(drafter, config, params, costs, session_id, trace, shared_memory, overlap)
    result = decode(OverGrpc(verifier), session_id, prompt_ids, max_new, stop_ids, clock)
    return result.output, result.steps, clock.total_ms, result.accepted, clock.ahead_steps


def _policy(overrides: list[str]) -> LoadPolicy:
    fields = {f.name: f.type for f in dataclasses.fields(LoadPolicy)}
    changes = {}
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--set: {name!r} is not a LoadPolicy field ({', '.join(fields)})")
        kind = type(getattr(LoadPolicy(), name))
        changes[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return LoadPolicy(**changes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="retrieval,mtbench")
    parser.add_argument("--modes", default="md16")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--overhead-ms", type=float, default=2.8)
    parser.add_argument("--drafter-ms", type=float, default=2.2)
    parser.add_argument("--probe-ms", type=float, default=1.6)
    parser.add_argument("--ahead-ms", type=float, default=0.0, help="what an ahead call beside a step adds to it")
    parser.add_argument("--forward-ms", help="the forward's cost by tokens, e.g. 1:1.88,16:1.97,64:2.90 "
                                             "(default: the Zen 3's)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--trace", action="store_true", help="print each step's nodes:accepted")
    parser.add_argument("--shared-memory", type=int, default=0, metavar="N",
                        help="also replay each mode with a memory shared across its requests, warmed on N other "
                             "prompts of the workload first (a server that has served that traffic)")
    args = parser.parse_args(argv)
    forward = FORWARD_MS
    if args.forward_ms:
        forward = [(int(tokens), 1, float(ms)) for tokens, ms in (item.split(":") for item in args.forward_ms.split(","))]
    costs = StepCosts(args.overhead_ms, args.drafter_ms, args.probe_ms, CostCurve.from_points(forward), args.ahead_ms)
    policy = _policy(args.set)
    workdir = Path(tempfile.mkdtemp(prefix="pardec-replay-")) / "stack"
    rows = []
    with launch(workdir, MODES["md16"]) as stack:
        verifier_address, drafter_address = stack.addresses[stack.verifier_names[0]], stack.addresses["drafter-0"]
        verifier = VerifierClient(verifier_address, 120.0)
        drafter = DrafterClient(drafter_address, 10.0, 0.5)
        info = verifier.model_info(60.0)
        stop_ids = set(info.stop_token_ids)
        tokenizer = info.tokenizer
        config = GatewayConfig(verifier_address, drafter_address, load_policy=policy)
        for workload in args.workloads.split(","):
            prompts = [tokenizer.encode_chat(p) for p in workloads.load(workload, args.prompts)]
            plain = [replay(verifier, drafter, config, None, ids, args.max_new_tokens, stop_ids, costs,
                            f"plain-{workload}-{i}") for i, ids in enumerate(prompts)]
            plain_ms = sum(run[2] for run in plain)
            plain_tokens = sum(len(run[0]) for run in plain)
            variants, warm_up = [(mode, "") for mode in args.modes.split(",")], []
            if args.shared_memory:
                variants += [(mode, f"replay-{workload}-{mode}") for mode in args.modes.split(",")]
                warm_up = [tokenizer.encode_chat(p) for p in workloads.held_out(workload, args.prompts, args.shared_memory)]
            for mode, shared in variants:
                base, suffixes = split_mode(mode)
                params, overlap = DraftParams(**MODES[base]), OVERLAP in suffixes
                label = f"{mode}+shared({len(warm_up)})" if shared else mode
                for i, ids in enumerate(warm_up if shared else []):  # not counted: it fills the memory
                    replay(verifier, drafter, config, params, ids, args.max_new_tokens, stop_ids, costs,
                           f"warm-{label}-{workload}-{i}", shared_memory=shared)
                traces = [[] for _ in prompts]
                runs = [replay(verifier, drafter, config, params, ids, args.max_new_tokens, stop_ids, costs,
                               f"{label}-{workload}-{i}", traces[i], shared, overlap) for i, ids in enumerate(prompts)]
                if args.trace:
                    for i, steps in enumerate(traces):
                        print(f"{workload} {label} prompt {i}: {' '.join(steps)}")
                identical = all(out == ref[0] for (out, *_), ref in zip(runs, plain))
                per_prompt = [round(ref[2] / run[2], 3) for run, ref in zip(runs, plain)]
                steps = sum(run[1] for run in runs)
                row = {
                    "workload": workload, "mode": label,
                    "speedup": round(plain_ms / sum(run[2] for run in runs), 3),
                    "per_prompt": per_prompt,
                    "tokens_per_step": round(1 + sum(run[3] for run in runs) / steps, 2),
                    "drafted_ahead": round(sum(run[4] for run in runs) / steps, 3),  # share of the steps
                    "plain_tok_s": round(plain_tokens / plain_ms * 1e3, 1),
                    "identical": identical,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"policy": dataclasses.asdict(policy), "rows": rows}, indent=1))
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
