"""`pardec bench`: what parallel decoding buys on this machine, through the real gRPC stack.

For each algorithm configuration a stack is started (as `pardec up` does: Redis, verifier,
drafter, gateway as processes); every batch of prompts then runs in plain mode and in the
stack's parallel mode back to back, for --rounds rounds in alternating order (plain first, then
parallel first), so ratios are taken side by side on the same noisy machine and a drift of its
speed during a pair hits both arms alike. Before its rounds each cell runs its batch once in
plain mode, not counted: a warm-up, and the reference every later output must equal. A cell's
speedup is the median of its rounds' ratios; its tok/s, steps and latencies pool all rounds. Its
decode speedup is the median of the rounds' TPOT ratios (time per output token after the first):
the decoding phase alone, without the prefill that drafting leaves as it is.
With --control each round also runs plain a second time: the A/A rows show how far apart
identical work lands on this machine, the resolution of the other ratios at each concurrency.
Writes results.json, results.md and PNG plots to --out.

A mode named with "+shared" (md16+shared) runs its stack with the drafting memory shared across
requests. Before a workload's cells the memory learns from --shared-memory-warmup prompts of the
workload that are not measured (served in parallel mode, not counted), and every parallel arm
starts from that saved state: the rounds repeat the same prompts, and a memory holding a prompt's
own earlier answer would be a gain no new request gets. A mode named with "+embedded"
(md16+embedded) runs its stack without a drafter replica: the gateway drafts in its own process
(`pardec up --drafters 0`).

    pardec bench --workloads code_edit,humaneval --prompts 4 --concurrency 1,4 --out bench/out
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from tqdm import tqdm

from pardec.bench import workloads as workload_data
from pardec.bench.report import CONTROL, Cell
from pardec.bench.shared_memory import SharedMemorySnapshot
from pardec.bench.stack import EMBEDDED, MODES, OVERLAP, SERIAL, SHARED, gateway_stub, launch_mode, request, split_mode
from pardec.runtime.errors import ConfigError
from pardec.verifier.config import parse_device


def _measure(stub, cell: Cell, prompts: list[str], plain: bool, max_new: int, reference: dict) -> tuple[float, float]:
    """Runs ``prompts`` with ``cell.concurrency`` requests in flight; adds to ``cell``; returns
    this run's tok/s and its TPOT in ms (0s after an error)."""
    def one(prompt):
        return prompt, stub.Generate(request(prompt, plain, max_new), timeout=3600)

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(cell.concurrency) as pool:
            replies = list(pool.map(one, prompts))
    except grpc.RpcError as error:
        cell.error = f"{error.code().name}: {error.details()}"
        return 0.0, 0.0
    wall_s = time.perf_counter() - start
    cell.wall_s += wall_s
    tokens = sum(len(reply.token_ids) for _, reply in replies)
    decode_ms = sum(reply.stats.total_ms - reply.stats.ttft_ms for _, reply in replies)
    decode_tokens = sum(max(len(reply.token_ids) - 1, 0) for _, reply in replies)
    cell.decode_ms, cell.decode_tokens = cell.decode_ms + decode_ms, cell.decode_tokens + decode_tokens
    for prompt, reply in replies:
        cell.tokens += len(reply.token_ids)
        cell.steps += reply.stats.steps
        cell.accepted_drafts += reply.stats.accepted_draft_tokens
        cell.draft_nodes += reply.stats.draft_tokens
        cell.ttft_ms.append(reply.stats.ttft_ms)
        cell.latency_ms.append(reply.stats.total_ms)
        output = list(reply.token_ids)
        if plain:
            cell.outputs.setdefault(prompt, output)
            reference.setdefault(prompt, output)  # the cell's first plain run (its warm-up)
        if reference.get(prompt) != output:
            cell.identical = False
    return tokens / wall_s, (decode_ms / decode_tokens if decode_tokens else 0.0)


def round_order(turn: int, control: bool) -> tuple[str, ...]:
    """The arms of one round, in order: plain and the parallel mode alternate which goes first.
    The A/A control (plain again, measured as a cell of its own) takes the end opposite plain,
    so both plain arms sit alike around the parallel one.

    >>> [round_order(turn, False) for turn in (0, 1)]
    [('plain', 'parallel'), ('parallel', 'plain')]
    >>> [round_order(turn, True) for turn in (0, 1)]
    [('plain', 'parallel', 'control'), ('control', 'parallel', 'plain')]
    """
    if control:
        return ("plain", "parallel", "control") if turn % 2 == 0 else ("control", "parallel", "plain")
    return ("plain", "parallel") if turn % 2 == 0 else ("parallel", "plain")


def run_stack(mode: str, prompts_by_workload, concurrency, max_new, workdir, progress, rounds: int = 1,
              control: bool = False, warm_prompts: dict[str, list[str]] | None = None,
              device: str = "cpu") -> list[tuple[Cell, Cell]]:
    """(plain, mode) cell pairs on one stack configured for ``mode``; each pair was measured
    back to back on the same prompts, ``rounds`` times in alternating order. With ``control``,
    each round also runs plain a second time, and a (plain, CONTROL) pair per cell reports the
    ratios of identical work: the resolution of this machine's ratios at that concurrency. A "+shared"
    mode's parallel arms each start from its memory as ``warm_prompts[workload]`` left it."""
    workdir.mkdir(parents=True)
    shared = SHARED in split_mode(mode)[1]
    pairs = []
    with launch_mode(workdir, mode, device) as stack, gateway_stub(stack) as stub:
        stub.Generate(request("Hello", True, 4), timeout=600)  # warm-up
        for workload, prompts in prompts_by_workload.items():
            memory = None
            if shared:
                memory = SharedMemorySnapshot(stack.redis_url)
                memory.clear()
                warm = (warm_prompts or {}).get(workload, [])
                for prompt in warm:  # not counted: it fills the memory
                    stub.Generate(request(prompt, False, max_new), timeout=3600)
                memory.save()
                print(f"\n{workload}: the shared memory learned {memory.contexts()} contexts from {len(warm)} "
                      "prompts not measured", file=sys.stderr)
            for level in concurrency:
                batch = (prompts * level)[: max(len(prompts), level)]
                reference: dict = {}
                cells = {"plain": Cell(workload, "plain", level), "parallel": Cell(workload, mode, level),
                         "control": Cell(workload, CONTROL, level)}
                # Not counted: it warms the stack for these prompts, so that the arm opening
                # the cell does not pay for it alone.
                _measure(stub, Cell(workload, "warm-up", level), batch, True, max_new, reference)
                for turn in range(rounds):
                    rates = {}
                    for arm in round_order(turn, control):
                        if arm == "parallel" and memory is not None:
                            memory.restore()
                        rates[arm] = _measure(stub, cells[arm], batch, arm != "parallel", max_new, reference)
                    if any(cell.error for cell in cells.values()):
                        break
                    plain_rate, plain_tpot = rates["plain"]
                    for arm in rates.keys() - {"plain"}:
                        rate, tpot = rates[arm]
                        cells[arm].round_ratios.append(rate / plain_rate)
                        if tpot:
                            cells[arm].round_decode_ratios.append(plain_tpot / tpot)
                pairs.append((cells["plain"], cells["parallel"]))
                progress(cells["parallel"])
                if control:
                    pairs.append((cells["plain"], cells["control"]))
                    progress(cells["control"])
            if memory is not None:
                memory.close()
    return pairs


def _replayed_prompt_lookup(workload, prompts, prompt_ids, pairs, steps_of) -> dict:
    """Prompt lookup (k=10) replayed on pardec's own plain outputs of ``workload``: tokens per
    forward on the very text pardec's drafters were measured on."""
    outputs = next((plain.outputs for plain, _ in pairs if plain.workload == workload and plain.outputs), {})
    made = forwards = 0
    for prompt, ids in zip(prompts, prompt_ids):
        output = outputs.get(prompt, [])
        made, forwards = made + max(len(output) - 1, 0), forwards + steps_of(ids, output, 10)
    return {"workload": workload, "peer": "prompt lookup k=10 replayed on pardec's plain output",
            "tokens_per_s": None, "tokens_per_step": round(made / forwards, 3) if forwards else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pardec bench", description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(workload_data.WORKLOADS))
    parser.add_argument("--modes", default="md16,md16-dynamic,la-4-5-5",
                        help=f"of {','.join(MODES)}, each optionally with {SHARED} (the shared drafting memory) "
                             f"{EMBEDDED} (drafted in the gateway's process, no drafter replica), {OVERLAP} or "
                             f"{SERIAL} (drafting ahead of the verifier on or off)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2,
                        help="plain/parallel pairs per cell, in alternating order; the speedup is their median")
    parser.add_argument("--control", action="store_true",
                        help="also run plain twice per round on the first mode's stack and report the ratio of "
                             "identical work (mode 'plain (A/A control)'): how far apart two runs of the same "
                             "thing land here, the resolution of every other ratio at that concurrency")
    parser.add_argument("--peers", choices=("installed", "none"), default="installed",
                        help="also run transformers (plain, prompt lookup) and llama.cpp when installed, "
                             "on the same prompts at concurrency 1 after the stacks stop")
    parser.add_argument("--shared-memory-warmup", type=int, default=40, metavar="N",
                        help=f"prompts of each workload, not measured, that a {SHARED} mode's memory learns from "
                             "before its cells (fewer where the workload has fewer)")
    parser.add_argument("--device", default="cpu",
                        help="where the stacks' verifier runs the model: cpu, cuda[:N] or npu[:N] (the peers "
                             "stay on the CPU)")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    try:
        parse_device(args.device)
    except ConfigError as error:
        parser.error(str(error))
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        try:
            split_mode(mode)
        except ValueError as error:
            parser.error(str(error))
    if args.shared_memory_warmup < 0:
        parser.error(f"--shared-memory-warmup: must be >= 0, got {args.shared_memory_warmup}")
    if args.rounds < 1:
        parser.error(f"--rounds: must be >= 1, got {args.rounds}")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    prompts = {w: workload_data.load(w, args.prompts) for w in args.workloads.split(",")}
    warm_prompts = ({w: workload_data.held_out(w, args.prompts, args.shared_memory_warmup) for w in prompts}
                    if any(SHARED in split_mode(m)[1] for m in modes) else None)
    total = (len(modes) + args.control) * len(prompts) * len(concurrency)

    def progress(cell: Cell) -> None:
        status = cell.error or f"{cell.tokens_per_s:.1f} tok/s"
        bar.set_postfix_str(f"{cell.workload} {cell.mode} c={cell.concurrency}: {status}", refresh=False)
        bar.update()

    pairs: list[tuple[Cell, Cell]] = []
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=total, file=sys.stderr, unit="cell") as bar:
        for index, mode in enumerate(modes):
            pairs += run_stack(mode, prompts, concurrency, args.max_new_tokens, Path(tmp) / str(index), progress,
                               args.rounds, control=args.control and index == 0, warm_prompts=warm_prompts,
                               device=args.device)
    from pardec.bench.peers import measure_peers, prompt_lookup_steps
    from pardec.verifier.model.weights import load_checkpoint

    tokenizer = load_checkpoint(None).tokenizer
    prompt_ids = {w: [tokenizer.encode_chat(p) for p in ps] for w, ps in prompts.items()}
    peer_rows = [_replayed_prompt_lookup(w, ps, prompt_ids[w], pairs, prompt_lookup_steps) for w, ps in prompts.items()]
    from pardec.bench.report import write

    rows = [parallel.summary(plain) for plain, parallel in pairs]
    write(rows, Path(args.out), vars(args), peer_rows)  # pardec's figures are safe before the peers run
    if args.peers == "installed":
        print("peers: transformers (and llama.cpp if installed) on the same prompts...", file=sys.stderr)
        peer_rows += measure_peers(prompt_ids, args.max_new_tokens)
        write(rows, Path(args.out), vars(args), peer_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
