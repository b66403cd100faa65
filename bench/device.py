"""The device engine's prepared check on one GPU: its tests, then what a step costs, in one run.

    python -m pardec.bench.device [--quick] [--out DIR] [--device cuda] [--skip-tests] [--e2e]

1. Tests (unless --skip-tests): `pytest tests/test_device_engine.py tests/test_verifier_cuda.py
   --device cuda` in a subprocess -- every kernel against its reference, batch invariance of each
   per-row kernel, a 64-node tree against plain decoding, drafted greedy sessions against plain.
   --e2e adds tests/test_end_to_end.py through the whole gRPC stack.
2. Step cost of the bundled model's verifier forward (wall time, host packing and the copy of the
   logits included) at 512 cached positions (and 2,048 in the full mode): trees of 1, 4, 16 and
   64 tokens, batches of 1, 4 and 16 sessions; every configuration once per round, round-robin,
   median over rounds.
3. Kernel launches per step: torch.profiler over one 1-token step of the engine replaying its
   CUDA graph, the same step run eagerly, and transformer.py's module-by-module forward (fp64 attention:
   the path before the device engine).
4. Where the 1-token step's GPU time goes: its replayed graph timed alone, its kernels by time.
5. Full mode only: attention tunings side by side, and plain greedy decoding, tokens/s after the
   prompt: pardec's Engine (one session, no drafts) against transformers (bf16, the same GGUF,
   the same GPU, dynamic and static caches), alternating.

--quick keeps the tests and the headline step costs (512 positions; 1, 16 and 64 tokens; 16
sessions), launches and profile.

Writes device.json and device.md to --out (default bench/out) and prints the Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

QUICK = dict(contexts=[512], trees=[1, 16, 64], batches=[1, 16], rounds=15, new_tokens=64)  # no peers
FULL = dict(contexts=[512, 2048], trees=[1, 4, 16, 64], batches=[1, 4, 16], rounds=25, new_tokens=128)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")


def run_tests(device: str, e2e: bool) -> dict:
    files = ["tests/test_device_engine.py", "tests/test_verifier_cuda.py"] + (["tests/test_end_to_end.py"] if e2e else [])
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "--device", device]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:  # a hung test must not take the whole run with it
        output, code = f"{expired.stdout or ''}{expired.stderr or ''}\ntimed out after 300 s", -1
    tail = output.strip().splitlines()
    print("\n".join(tail[-40:]), flush=True)
    return {"files": files, "exit_code": code, "summary": tail[-1] if tail else "",
            "seconds": round(time.perf_counter() - start, 1)}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def chain(tokens: int, cache, generator: torch.Generator, vocab: int):
    from pardec.verifier.model.step import StepInput

    return StepInput(torch.randint(0, vocab, (tokens,), generator=generator), torch.arange(tokens),
                     torch.ones(tokens, tokens, dtype=torch.bool).tril(), cache)


def prefilled(model, pool, count: int, context: int, room: int) -> list:
    generator = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(count):
        cache = pool.session()
        cache.reserve(context)
        for a in range(0, context, 512):  # chunks, as the engine prefills
            size = min(512, context - a)
            step = chain(size, cache, generator, model.args.vocab_size)
            step.output_rows = torch.zeros(0, dtype=torch.int64)
            model.forward_batch([step])
            cache.commit(torch.arange(size), trim=False)
        cache.reserve(room)
        caches.append(cache)
    return caches


@torch.inference_mode()
def step_costs(model, context: int, trees, batches, rounds: int) -> dict[tuple[int, int], float]:
    """Median ms of one forward for (T tokens per session, B sessions) at `context` positions."""
    room = max(*trees, 16)
    pool = model.new_pool(max(batches) * (context + room + 64), 32)
    caches = prefilled(model, pool, max(batches), context, room)
    generator = torch.Generator().manual_seed(1)
    vocab = model.args.vocab_size
    configs = sorted({(t, 1) for t in trees} | {(t, b) for b in batches for t in (1, 16)})
    steps = {(t, b): [chain(t, cache, generator, vocab) for cache in caches[:b]] for t, b in configs}
    times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    for repeat in range(rounds + 2):
        for config in configs:
            synchronize()
            start = time.perf_counter()
            model.forward_batch(steps[config])
            synchronize()
            if repeat >= 2:  # the first rounds compile kernels and capture graphs
                times[config].append((time.perf_counter() - start) * 1e3)
    for cache in caches:
        cache.free()
    return {config: statistics.median(values) for config, values in times.items()}


@torch.inference_mode()
def launches_per_step(model, context: int = 512) -> dict:
    """Launch calls on the host and kernels on the GPU for one 1-token step, three ways."""
    from torch.profiler import ProfilerActivity, profile

    from pardec.verifier.model.kvcache import KVPool

    def count(run) -> dict:
        run()
        synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            synchronize()
        events = prof.events()
        host = sum(1 for e in events if e.name in LAUNCH_CALLS)
        kernels = sum(1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
        return {"host_launch_calls": host, "gpu_kernels_and_copies": kernels}

    generator = torch.Generator().manual_seed(2)
    engine = model.device_forward
    pool = model.new_pool(context + 128, 32)
    cache = prefilled(model, pool, 1, context, 16)[0]
    step = chain(1, cache, generator, model.args.vocab_size)
    result = {"graph replay": count(lambda: model.forward_batch([step]))}
    engine.use_graphs = False
    try:
        result["eager kernels"] = count(lambda: model.forward_batch([step]))
    finally:
        engine.use_graphs = True
    # transformer.py's modules over an fp32 pool: the accelerator path before the device engine.
    fp32_pool = KVPool(model.args, context + 128, 32, pool.kv.device)
    fp32_pool.kv.zero_()
    old_cache = fp32_pool.session()
    old_cache.reserve(context + 1)
    old_cache.length = context  # the keys' values do not change the launch count or the time
    old_step = chain(1, old_cache, generator, model.args.vocab_size)
    model.device_forward, model.attention = None, "fp64"
    try:
        result["modules, fp64 attention (before)"] = count(lambda: model.forward_batch([old_step]))
        times = []
        for _ in range(7):
            synchronize()
            start = time.perf_counter()
            model.forward_batch([old_step])
            synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        result["modules, fp64 attention (before)"]["step_ms"] = round(statistics.median(times), 2)
    finally:
        model.device_forward, model.attention = engine, "triton"
    cache.free()
    return result


@torch.inference_mode()
def gpu_profile(model, context: int = 512, top: int = 12) -> dict:
    """GPU time of one 1-token step as a replayed graph (no host work between replays), and the
    kernels that take it, from the same step run eagerly under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    engine = model.device_forward
    pool = model.new_pool(context + 128, 32)
    cache = prefilled(model, pool, 1, context, 16)[0]
    step = chain(1, cache, torch.Generator().manual_seed(3), model.args.vocab_size)
    model.forward_batch([step])
    model.forward_batch([step])  # captured
    graph = engine._graphs[id(pool), 32]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    synchronize()
    begin.record()
    for _ in range(50):
        graph.replay()
    end.record()
    synchronize()
    replay_ms = begin.elapsed_time(end) / 50
    engine.use_graphs = False
    try:
        model.forward_batch([step])
        synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.forward_batch([step])
            synchronize()
    finally:
        engine.use_graphs = True
    kernels = {}
    for event in prof.events():
        if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
            name = event.name[:60]
            total, count = kernels.get(name, (0.0, 0))
            kernels[name] = (total + event.time_range.elapsed_us(), count + 1)
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])[:top]
    cache.free()
    return {"graph_replay_gpu_ms": round(replay_ms, 3),
            "eager_kernel_us": {name: {"total_us": round(t, 1), "calls": c} for name, (t, c) in ranked},
            "eager_kernel_total_us": round(sum(t for t, _ in kernels.values()), 1)}


@torch.inference_mode()
def attention_variants(model, context: int = 512, rounds: int = 15) -> dict:
    """The 1- and 64-token step with other attention tunings (each its own graphs), side by side."""
    from pardec.verifier.kernels import triton_attention

    default = dict(triton_attention.ATTENTION_TUNING)
    variants = [dict(chunk=128, budget=8192, num_warps=4), dict(chunk=64, budget=8192, num_warps=4),
                dict(chunk=256, budget=8192, num_warps=4), dict(chunk=128, budget=16384, num_warps=4),
                dict(chunk=64, budget=4096, num_warps=2)]
    results = {}
    try:
        for variant in variants:
            triton_attention.ATTENTION_TUNING.update(variant)
            model.device_forward._graphs.clear()
            costs = step_costs(model, context, [1, 64], [1], rounds)
            results[f"chunk {variant['chunk']}, budget {variant['budget']}, {variant['num_warps']} warps"] = {
                f"{t}x{b}": round(ms, 3) for (t, b), ms in costs.items() if b == 1 and t in (1, 64)}
    finally:
        triton_attention.ATTENTION_TUNING.update(default)
        model.device_forward._graphs.clear()
    return results


def pardec_decode_rate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of plain greedy decoding after the prompt, through the Engine (thread, queue and
    acceptance included), one session at a time."""
    from pardec.bench.decode import InProcess, decode
    from pardec.verifier.config import VerifierConfig
    from pardec.verifier.engine.engine import Engine

    device = str(model.norm.weight.device)
    engine = Engine(model, tokenizer, "bench", VerifierConfig(measure_cost_curve=False, device=device,
                                                               kv_pool_tokens=16384, batch_wait_ms=0.0),
                    device=device)
    try:  # no stop token: every prompt makes new_tokens, the steps' wall time after the prefill
        runs = [decode(InProcess(engine), f"s{index}", prompt, new_tokens) for index, prompt in enumerate(prompts)]
    finally:
        engine.close()
    return sum(len(run.output) - 1 for run in runs) / sum(run.decode_s for run in runs)


@torch.inference_mode()
def transformers_decode_rate(peer, prompts: list[list[int]], new_tokens: int, cache: str | None) -> float:
    """Tokens/s after the prompt: generate(new_tokens) minus generate(1), per prompt."""
    kwargs = {"cache_implementation": cache} if cache else {}

    def generate(ids, count):
        inputs = torch.tensor([ids], device="cuda")
        synchronize()
        start = time.perf_counter()
        peer.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=count, min_new_tokens=count,
                      do_sample=False, pad_token_id=0, **kwargs)
        synchronize()
        return time.perf_counter() - start

    generate(prompts[0], 4)  # warm-up
    tokens, seconds = 0, 0.0
    for ids in prompts:
        seconds += generate(ids, new_tokens) - generate(ids, 1)
        tokens += new_tokens - 1
    return tokens / seconds


def peer_comparison(model, checkpoint, new_tokens: int) -> dict:
    from pardec.bench.peers import load_transformers_model
    from tests.prompts import CHAT_PROMPTS, CODE_PROMPTS

    prompts = [checkpoint.tokenizer.encode_chat(p) for p in [*CODE_PROMPTS[:2], *CHAT_PROMPTS[:2]]]
    peer = load_transformers_model().to(device="cuda", dtype=torch.bfloat16)
    rates = {"pardec engine (W8A8, plain)": [], "transformers bf16, dynamic cache": [],
             "transformers bf16, static cache": []}
    for _ in range(2):  # alternating, so drift hits both alike
        rates["pardec engine (W8A8, plain)"].append(pardec_decode_rate(model, checkpoint.tokenizer, prompts, new_tokens))
        rates["transformers bf16, dynamic cache"].append(transformers_decode_rate(peer, prompts, new_tokens, None))
        try:
            rates["transformers bf16, static cache"].append(transformers_decode_rate(peer, prompts, new_tokens, "static"))
        except Exception as error:  # a transformers release without it: report, do not fail the run
            print(f"transformers static cache failed: {error}", flush=True)
    result = {name: round(max(values), 1) for name, values in rates.items() if values}
    best_peer = max(v for k, v in result.items() if k.startswith("transformers"))
    result["pardec / best transformers"] = round(result["pardec engine (W8A8, plain)"] / best_peer, 2)
    return result


def markdown(report: dict) -> str:
    lines = [f"# Device engine, {report['date']}: {report['gpu']}", "",
             f"torch {report['torch']}, triton {report['triton']}, mode {report['mode']}, "
             f"command `{report['command']}`", ""]
    if "tests" in report:
        tests = report["tests"]
        lines += [f"**Tests** (`{' '.join(tests['files'])} --device cuda`): {tests['summary']} "
                  f"(exit {tests['exit_code']}, {tests['seconds']} s)", ""]
    for context, costs in report["step_ms"].items():
        base = costs["1x1"]
        lines += [f"**Step cost at {context} cached positions** (ms; x the 1-token step)", "",
                  "| tokens per session \\ sessions | " + " | ".join(report["batches"]) + " |",
                  "|---" * (len(report["batches"]) + 1) + "|"]
        for tokens in report["trees"]:
            cells = []
            for batch in report["batches"]:
                key = f"{tokens}x{batch}"
                cells.append(f"{costs[key]:.2f} ({costs[key] / base:.2f}x)" if key in costs else "")
            lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["**Launches per 1-token step**", "", "| path | host launch calls | GPU kernels and copies | step ms |",
              "|---|---:|---:|---:|"]
    for path, counts in report["launches"].items():
        lines.append(f"| {path} | {counts['host_launch_calls']} | {counts['gpu_kernels_and_copies']} | "
                     f"{counts.get('step_ms', '')} |")
    profile = report.get("profile")
    if profile:
        lines += ["", f"**Where a 1-token step goes** (512 positions): the replayed graph keeps the GPU "
                  f"{profile['graph_replay_gpu_ms']} ms; the same step's kernels run eagerly, by total time "
                  f"({profile['eager_kernel_total_us']} us in all):", "", "| kernel | calls | us |", "|---|---:|---:|"]
        lines += [f"| `{name}` | {v['calls']} | {v['total_us']} |" for name, v in profile["eager_kernel_us"].items()]
    if report.get("attention_variants"):
        lines += ["", "**Attention tunings** (ms at 512 positions)", "", "| tuning | 1 token | 64 tokens |",
                  "|---|---:|---:|"]
        lines += [f"| {name} | {v.get('1x1', '')} | {v.get('64x1', '')} |" for name, v in report["attention_variants"].items()]
    if "decode_tokens_per_s" in report:
        lines += ["", "**Plain greedy decoding after the prompt, tokens/s** (one session, same GPU)", "",
                  "| | tokens/s |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in report["decode_tokens_per_s"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 positions, fewer configurations and rounds")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--e2e", action="store_true", help="also the end-to-end tests through the gRPC stack")
    parser.add_argument("--skip-peers", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.device needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from pardec.verifier.loading import load_model
    from pardec.verifier.model.weights import load_checkpoint

    plan = QUICK if args.quick else FULL
    began = time.perf_counter()
    report: dict = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "host": platform.node(), "mode": "quick" if args.quick else "full",
        "command": "python -m pardec.bench.device " + " ".join(argv if argv is not None else sys.argv[1:]),
        "trees": [str(t) for t in plan["trees"]], "batches": [str(b) for b in plan["batches"]],
    }
    if not args.skip_tests:
        report["tests"] = run_tests(args.device, args.e2e)
    checkpoint = load_checkpoint(None)
    model = load_model(checkpoint, "w8a8", device=args.device)
    print(f"model loaded at {time.perf_counter() - began:.0f} s: kernel {model.kernel}, attention {model.attention}",
          flush=True)
    report["step_ms"] = {}
    for context in plan["contexts"]:
        costs = step_costs(model, context, plan["trees"], plan["batches"], plan["rounds"])
        report["step_ms"][str(context)] = {f"{t}x{b}": round(ms, 3) for (t, b), ms in costs.items()}
        print(f"{context} positions: " + ", ".join(f"{k} {v:.2f} ms" for k, v in report["step_ms"][str(context)].items()),
              flush=True)
    report["launches"] = launches_per_step(model)
    print(json.dumps(report["launches"]), flush=True)
    report["profile"] = gpu_profile(model)
    print(json.dumps(report["profile"], indent=1), flush=True)
    if not args.quick:
        report["attention_variants"] = attention_variants(model)
        print(json.dumps(report["attention_variants"]), flush=True)
    if not args.skip_peers and not args.quick:
        report["decode_tokens_per_s"] = peer_comparison(model, checkpoint, plan["new_tokens"])
        print(json.dumps(report["decode_tokens_per_s"]), flush=True)
    report["graph_replays"], report["eager_runs"] = model.device_forward.graph_replays, model.device_forward.eager_runs
    report["seconds"] = round(time.perf_counter() - began, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "device.md").write_text(text)
    print(text, flush=True)
    print(f"done in {report['seconds']} s", flush=True)
    return 0 if report.get("tests", {}).get("exit_code", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
