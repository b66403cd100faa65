"""The device engine's prepared check on one GPU: its tests, then what a step costs, in one run.

    python -m pardec.bench.device [--quick] [--choose-attention] [--attention K=V,...] [--e2e]
                                  [--out DIR] [--device cuda] [--skip-tests] [--skip-peers]

1. Attention tunings (full mode, or --choose-attention): the 1- and 64-token step at 512
   positions for each of ATTENTION_VARIANTS side by side; --choose-attention then runs all that
   follows with the fastest (least 1-token plus 64-token step), --attention with the one given.
2. Tests (unless --skip-tests): `pytest tests/test_device_engine.py tests/test_device_engine_qwen3.py
   tests/test_int8_gemm.py tests/test_verifier_cuda.py --device cuda` in a subprocess with that tuning -- every kernel
   against its reference, batch invariance of each per-row kernel (Qwen3's q/k head norms
   included), a 64-node tree against plain decoding, drafted greedy sessions against plain. --e2e adds tests/test_end_to_end.py through the whole gRPC stack.
3. Step cost of the bundled model's verifier forward (wall time, host packing and the copy of the
   logits included) at 512 cached positions (and 2,048 in the full mode): trees of 1, 4, 16 and
   64 tokens, batches of 1, 4 and 16 sessions; every configuration once per round, round-robin,
   median over rounds.
4. Kernel launches per step: torch.profiler over one 1-token step of the engine replaying its
   CUDA graph, the same step run eagerly, and transformer.py's module-by-module forward (fp64
   attention: the path before the device engine).
5. Where the 1-token step's GPU time goes: its replayed graph timed alone, its kernels by time.
6. Full mode only: plain greedy decoding, tokens/s after the prompt: pardec's Engine (one
   session, no drafts) against transformers (bf16, the same GGUF, the same GPU, dynamic and
   static caches), alternating.

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


def run_tests(device: str, e2e: bool, tuning: str = "") -> dict:
    files = ["tests/test_device_engine.py", "tests/test_device_engine_qwen3.py", "tests/test_int8_gemm.py",
             "tests/test_verifier_cuda.py",
             *(["tests/test_end_to_end.py"] if e2e else [])]
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "--device", device,
               *(["--attention-tuning", tuning] if tuning else [])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:  # a hung test must not take the whole run with it
        output, code = f"{expired.stdout or ''}{expired.stderr or ''}\ntimed out after 300 s", -1
    tail = output.strip().splitlines()
    print("\n".join(tail[-40:]), flush=True)
    return {"files": files, "attention_tuning": tuning, "exit_code": code, "summary": tail[-1] if tail else "",
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
def step_costs(model, context: int, trees, batches, rounds: int, grid: bool = False) -> dict[tuple[int, int], float]:
    """Median ms of one forward for (T tokens per session, B sessions) at `context` positions:
    every tree alone and 1 and 16 tokens in every batch, or (grid) every tree in every batch."""
    room = max(*trees, 16)
    pool = model.new_pool(max(batches) * (context + room + 64), 32)
    caches = prefilled(model, pool, max(batches), context, room)
    generator = torch.Generator().manual_seed(1)
    vocab = model.args.vocab_size
    configs = sorted({(t, 1) for t in trees} | {(t, b) for b in batches for t in (trees if grid else (1, 16))})
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
def gpu_profile(model, context: int = 512, top: int = 12, tokens: int = 1) -> dict:
    """GPU time of one step of `tokens` as a replayed graph (no host work between replays), and
    the kernels that take it, from the same step run eagerly under the profiler."""
    from pardec.verifier.model.device_forward import padded_rows
    from torch.profiler import ProfilerActivity, profile

    engine = model.device_forward
    pool = model.new_pool(context + 128, 32)
    cache = prefilled(model, pool, 1, context, max(16, tokens))[0]
    step = chain(tokens, cache, torch.Generator().manual_seed(3), model.args.vocab_size)
    model.forward_batch([step])
    model.forward_batch([step])  # captured
    graph = engine._graphs[id(pool), padded_rows(tokens, True)]
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


# Attention tunings bench.device times side by side (the first is the engine's default).
ATTENTION_VARIANTS = [
    dict(chunk=64, block_n=32, num_warps=4, products="tf32x3"),
    dict(chunk=128, budget=8192, block_n=None, num_warps=4, products="sum"),
    dict(chunk=128, block_n=64, num_warps=4, products="ieee"),
    dict(chunk=128, block_n=64, num_warps=4, products="tf32x3"),
    dict(chunk=256, block_n=64, num_warps=4, products="tf32x3"),
    dict(chunk=64, block_n=64, num_warps=4, products="tf32x3"),
]


def tuning_text(tuning: dict) -> str:
    return ",".join(f"{key}={'none' if value is None else value}" for key, value in tuning.items())


@torch.inference_mode()
def attention_variants(model, context: int = 512, rounds: int = 15) -> dict:
    """The 1- and 64-token step with each attention tuning (each its own graphs), side by side."""
    from pardec.verifier.kernels import triton_attention

    default = dict(triton_attention.ATTENTION_TUNING)
    results = {}
    try:
        for variant in ATTENTION_VARIANTS:
            triton_attention.ATTENTION_TUNING.update(default)
            triton_attention.ATTENTION_TUNING.update(variant)
            model.device_forward._graphs.clear()
            try:
                costs = step_costs(model, context, [1, 64], [1], rounds)
            except Exception as error:  # a tuning this Triton cannot compile: report it, go on
                print(f"attention tuning {tuning_text(variant)} failed: {error}", flush=True)
                continue
            results[tuning_text(variant)] = {f"{t}x{b}": round(ms, 3) for (t, b), ms in costs.items()
                                             if b == 1 and t in (1, 64)}
            print(f"{tuning_text(variant)}: {results[tuning_text(variant)]}", flush=True)
    finally:
        triton_attention.ATTENTION_TUNING.clear()
        triton_attention.ATTENTION_TUNING.update(default)
        model.device_forward._graphs.clear()
    return results


def choose_attention(variants: dict) -> str:
    """The tuning with the least 1-token plus 64-token step (the device issue's two targets)."""
    return min(variants, key=lambda name: variants[name]["1x1"] + variants[name]["64x1"])


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 positions, fewer configurations and rounds")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--e2e", action="store_true", help="also the end-to-end tests through the gRPC stack")
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--attention", default="", help="attention tuning for the whole run, key=value,...")
    parser.add_argument("--choose-attention", action="store_true",
                        help="time the attention tunings first, then run everything with the fastest")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.device needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from pardec.bench.device_report import markdown
    from pardec.verifier.kernels import triton_attention
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
    triton_attention.ATTENTION_TUNING.update(triton_attention.parse_attention_tuning(args.attention))
    checkpoint = load_checkpoint(None)
    model = load_model(checkpoint, "w8a8", device=args.device)
    print(f"model loaded at {time.perf_counter() - began:.0f} s: kernel {model.kernel}, attention {model.attention}",
          flush=True)
    if args.choose_attention or not args.quick:
        report["attention_variants"] = attention_variants(model)
    if args.choose_attention and report["attention_variants"]:
        chosen = choose_attention(report["attention_variants"])
        triton_attention.ATTENTION_TUNING.update(triton_attention.parse_attention_tuning(chosen))
        print(f"chosen attention tuning: {chosen}", flush=True)
    report["attention_tuning"] = tuning_text(triton_attention.ATTENTION_TUNING)
    model.device_forward._graphs.clear()
    if not args.skip_tests:  # in a subprocess, with the tuning in force here
        report["tests"] = run_tests(args.device, args.e2e, report["attention_tuning"])
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
