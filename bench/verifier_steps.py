"""What a verifier step costs by tree size and by batch, batched throughput, and plain decoding
against Hugging Face transformers -- all in one process, side by side, printed as Markdown.

    python -m pardec.bench.verifier_steps [--contexts 512 2048] [--trees 1 4 8 16 32 64]
                                   [--batches 1 4 16] [--repeats 15] [--threads 2]
                                   [--throughput] [--peers] [--new-tokens 64]
                                   [--compare-attention] [--compare-kernels] [--compare-fusion]
                                   [--compare-kv-dtype] [--model DIR_OR_GGUF]

Step cost: every session holds `context` committed positions (a random prompt), and each step
is a chain of T tokens (a step's cost depends on its token count, not on the tree's shape). The
steps are never committed, so every repeat sees the same caches. All configurations of one
context run round-robin, once per repeat, and each reports its median: a burst of load from
other processes then hits every configuration alike, and the ratios to the 1-token step stay
comparable on a shared machine.

--compare-attention: step cost by tree size with the native fp32 attention and the fp64 one,
two models in one process, interleaved (at the first context).

--compare-kernels: the same with the W8A8 GEMM kernels that are exact here (native C, torch's
_int_mm), both with the native attention.

--compare-kv-dtype: the served engine with its KV cache in fp32 and in bf16, at every --contexts.

--compare-fusion: the served engine with each decoder layer in one C call (native_layers.py)
and with the layers as Python modules over the same kernels (the same bits, see
tests/test_native_layers.py).

--throughput: decode tokens/s of 1, 4 and 16 concurrent sessions through the Engine, with
continuous batching and without (bench.verifier_batching.run_sessions).

--peers: greedy generation of --new-tokens from the same chat prompts, prompt included in the
time, by pardec's engine (W8A8, one session, plain steps) and by transformers' `generate`
(fp32, bench.peers.load_transformers_model), alternating prompt by prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pardec.bench.decode import InProcess, decode
from pardec.runtime.errors import ConfigError
from pardec.verifier.loading import load_model
from pardec.verifier.engine.devices import resolve_device
from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.model.step import StepInput
from pardec.verifier.model.transformer import Transformer
from pardec.verifier.kernels.openmp import release_thread_pool
from pardec.verifier.model.quant import choose_kernel, int_mm_is_exact, native_is_exact
from pardec.verifier.model.weights import load_checkpoint
from pardec.verifier.prepare.cache import PreparedCache, default_directory


def model_device(model: Transformer) -> torch.device:
    return model.norm.weight.device


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work, so a wall-clock interval covers it (CUDA runs async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chain(tokens: int, cache, generator: torch.Generator, vocab: int, device=None) -> StepInput:
    device = device or torch.device("cpu")
    return StepInput(
        torch.randint(0, vocab, (tokens,), generator=generator).to(device),
        torch.arange(tokens, device=device),
        torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril(),
        cache,
    )


def prefilled_sessions(model: Transformer, pool: KVPool, count: int, context: int, room: int) -> list:
    """`count` sessions of `context` random committed positions, with `room` reserved beyond."""
    generator = torch.Generator().manual_seed(0)
    device = model_device(model)
    caches = []
    for _ in range(count):
        cache = pool.session()
        cache.reserve(context)
        prompt = torch.randint(0, model.args.vocab_size, (context,), generator=generator)
        for a in range(0, context, 512):  # chunks, as the engine prefills
            chunk = prompt[a : a + 512]
            step = chain(chunk.shape[0], cache, generator, model.args.vocab_size, device)
            step.tokens, step.output_rows = chunk.to(device), torch.zeros(0, dtype=torch.int64, device=device)
            model.forward_batch([step])
            cache.commit(torch.arange(chunk.shape[0]), trim=False)
        cache.reserve(room)
        caches.append(cache)
    return caches


@torch.inference_mode()
def step_costs(model: Transformer, context: int, trees, batches, repeats: int) -> dict[tuple[int, int], float]:
    """Median ms of one forward for (T tokens per session, B sessions), at `context` positions."""
    room = max(*trees, 16)
    device = model_device(model)
    pool = model.new_pool(max(batches) * (context + room + 64), 32, device)
    caches = prefilled_sessions(model, pool, max(batches), context, room)
    generator = torch.Generator().manual_seed(1)
    vocab = model.args.vocab_size
    configs = sorted({(t, 1) for t in trees} | {(t, b) for b in batches for t in (1, 16)})
    steps = {(t, b): [chain(t, cache, generator, vocab, device) for cache in caches[:b]] for t, b in configs}
    times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    for repeat in range(repeats + 1):
        for config in configs:
            synchronize(device)
            start = time.perf_counter()
            model.forward_batch(steps[config])
            synchronize(device)
            if repeat:  # the first round warms caches and allocators
                times[config].append((time.perf_counter() - start) * 1e3)
    for cache in caches:
        cache.free()
    return {config: statistics.median(values) for config, values in times.items()}


@torch.inference_mode()
def print_engine_comparison(checkpoint, engines: dict[str, tuple], context: int, trees,
                            repeats: int, loaded: Transformer | None = None, prepared=None) -> None:
    """Step cost by tree size of models built with other (kernel, attention, fused layers[, KV cache
    dtype]) choices, side by side: all in one process, every configuration of every model in one
    round-robin per repeat. Engines that differ only in fusion share one model (`loaded` if its
    choices match), its fused layers switched off for the unfused one's steps."""
    built = {} if loaded is None else {(loaded.kernel, loaded.attention, loaded.kv_dtype): loaded}
    models = {}
    for label, (kernel, attention, fused, *kv_dtype) in engines.items():
        kv = kv_dtype[0] if kv_dtype else torch.float32
        if (kernel, attention, kv) not in built:
            built[kernel, attention, kv] = load_model(checkpoint, "w8a8", kernel=kernel, attention=attention,
                                                      prepared_cache=prepared, kv_dtype=kv)
        model = built[kernel, attention, kv]
        models[label] = (model, model.fused_layers if fused else None)
    as_built = [(model, model.fused_layers) for model in built.values()]
    steps, times = {}, {}
    try:
        for name, (model, fused_layers) in models.items():
            model.fused_layers = fused_layers
            pool = model.new_pool(context + max(*trees, 16) + 64, 32)
            cache = prefilled_sessions(model, pool, 1, context, max(*trees, 16))[0]
            generator = torch.Generator().manual_seed(1)
            for t in trees:
                steps[name, t] = chain(t, cache, generator, model.args.vocab_size)
                times[name, t] = []
        for repeat in range(repeats + 1):
            for (name, t), step in steps.items():
                model, fused_layers = models[name]
                model.fused_layers = fused_layers
                start = time.perf_counter()
                model.forward_batch([step])
                if repeat:
                    times[name, t].append((time.perf_counter() - start) * 1e3)
    finally:
        for model, fused_layers in as_built:  # each shared model back as it was built
            model.fused_layers = fused_layers
    costs = {key: statistics.median(values) for key, values in times.items()}
    print(f"\n**Side by side, {context} cached positions**\n")
    print("| kernels | " + " | ".join(f"{t} tokens" for t in trees) + " |")
    print("|---" * (len(trees) + 1) + "|")
    for name in models:
        print(f"| {name}: ms (x 1-token) | "
              + " | ".join(f"{costs[name, t]:.1f} ({costs[name, t] / costs[name, 1]:.2f}x)" for t in trees) + " |")


def print_step_costs(model: Transformer, contexts, trees, batches, repeats: int) -> None:
    for context in contexts:
        costs = step_costs(model, context, trees, batches, repeats)
        base = costs[1, 1]
        print(f"\n**Step cost at {context} cached positions per session** (1-token step = {base:.1f} ms)\n")
        print("| tree tokens | " + " | ".join(str(t) for t in trees) + " |")
        print("|---" * (len(trees) + 1) + "|")
        print("| ms | " + " | ".join(f"{costs[t, 1]:.1f}" for t in trees) + " |")
        print("| x 1-token step | " + " | ".join(f"{costs[t, 1] / base:.2f}" for t in trees) + " |")
        print("\n| sessions in one forward | " + " | ".join(str(b) for b in batches) + " |")
        print("|---" * (len(batches) + 1) + "|")
        for tokens in (1, 16):
            print(f"| {tokens} token(s) each: ms | " + " | ".join(f"{costs[tokens, b]:.1f}" for b in batches) + " |")
            print(f"| {tokens} token(s) each: x 1-token step | "
                  + " | ".join(f"{costs[tokens, b] / base:.2f}" for b in batches) + " |")
        extra = [(costs[1, b] - base) / (b - 1) for b in batches if b > 1]
        print("\nms per extra session (1 token each): " + ", ".join(
            f"{e:.1f} (at {b})" for e, b in zip(extra, [b for b in batches if b > 1])), flush=True)


def print_throughput(model: Transformer, checkpoint, sessions, new_tokens: int) -> None:
    device = str(model_device(model))
    from pardec.bench.verifier_batching import PROMPTS, run_sessions
    from pardec.verifier.config import VerifierConfig
    from pardec.verifier.engine.engine import Engine

    encoded = [checkpoint.tokenizer.encode_chat(p) for p in PROMPTS]
    modes = {"without batching": dict(max_batch_sessions=1, batch_wait_ms=0.0, max_batch_tokens=4096),
             "with batching": dict(batch_wait_ms=2.0)}
    print("\n**Decode throughput, plain steps**\n")
    print("| sessions | without batching tok/s | with batching tok/s | speedup |\n|---:|---:|---:|---:|")
    for count in sessions:
        rates = {}
        for mode, overrides in modes.items():
            engine = Engine(model, checkpoint.tokenizer, checkpoint.model_name,
                            VerifierConfig(measure_cost_curve=False, device=device, **overrides), device=device)
            rates[mode], _ = run_sessions(engine, [encoded[i % len(encoded)] for i in range(count)], new_tokens, "plain")
            engine.close()
        plain, batched = rates["without batching"], rates["with batching"]
        print(f"| {count} | {plain:.1f} | {batched:.1f} | {batched / plain:.2f}x |", flush=True)


def pardec_generate(engine, prompt: list[int], new_tokens: int, end_token: int) -> int:
    """Greedy plain decoding through the engine; returns how many tokens it generated."""
    return len(decode(InProcess(engine), "peer-bench", prompt, new_tokens, {end_token}).output)


def print_peers(model: Transformer, checkpoint, new_tokens: int, prompt_count: int) -> None:
    from pardec.bench.peers import load_transformers_model
    from pardec.bench.verifier_batching import PROMPTS
    from pardec.verifier.config import VerifierConfig
    from pardec.verifier.engine.engine import Engine

    end_token = 2  # <|im_end|>, the end of a turn, as bench.peers stops transformers
    hf = load_transformers_model()
    engine = Engine(model, checkpoint.tokenizer, checkpoint.model_name, VerifierConfig(measure_cost_curve=False))
    prompts = [checkpoint.tokenizer.encode_chat(p) for p in PROMPTS[:prompt_count]]
    totals = {"pardec": [0, 0.0], "transformers": [0, 0.0]}
    pardec_generate(engine, prompts[0], 8, end_token)  # warm-up for both
    engine.call(release_thread_pool)
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    release_thread_pool()
    for prompt in prompts:
        start = time.perf_counter()
        totals["pardec"][0] += pardec_generate(engine, prompt, new_tokens, end_token)
        totals["pardec"][1] += time.perf_counter() - start
        # Each side runs with the only OpenMP pool of the process (verifier/openmp.py): the engine
        # thread's pool left idle would slow transformers' parallel regions, and the reverse.
        engine.call(release_thread_pool)
        inputs = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            output = hf.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=[end_token])
        totals["transformers"][1] += time.perf_counter() - start
        totals["transformers"][0] += output.shape[1] - len(prompt)
        release_thread_pool()
    engine.close()
    rates = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    print(f"\n**Plain greedy decoding, {len(prompts)} chat prompts, up to {new_tokens} new tokens, prompt included**\n")
    print("| engine | tokens | tok/s | x transformers |\n|---|---:|---:|---:|")
    for name, label in (("pardec", "pardec (W8A8, Engine)"), ("transformers", "transformers generate (fp32)")):
        print(f"| {label} | {totals[name][0]} | {rates[name]:.1f} | {rates[name] / rates['transformers']:.2f}x |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--trees", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--throughput", action="store_true", help="also decode tok/s with and without batching")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--peers", action="store_true", help="also plain decoding vs transformers")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--compare-kernels", action="store_true",
                        help="step costs with each exact W8A8 GEMM kernel, side by side")
    parser.add_argument("--compare-attention", action="store_true",
                        help="also step costs with the native fp32 attention and fp64 side by side")
    parser.add_argument("--compare-kv-dtype", action="store_true",
                        help="also step cost with the KV cache in fp32 and in bf16 (--kv-cache-dtype), side by side")
    parser.add_argument("--compare-fusion", action="store_true",
                        help="also step costs with fused C layers and with Python modules side by side")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory or GGUF file (default: the bundled model); a float one is "
                             "prepared once into the prepared-weight cache, as a verifier does")
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda[:N]: where the step costs and --throughput run (the --compare-* "
                             "and --peers tables are CPU-only)")
    args = parser.parse_args(argv)
    if 1 not in args.trees or 1 not in args.batches:
        parser.error("--trees and --batches must include 1 (the reference step)")
    try:
        device = resolve_device(args.device)
    except ConfigError as error:
        parser.error(str(error))
    if device.type != "cpu" and (args.compare_attention or args.compare_kernels or args.compare_fusion or args.peers
                                 or args.compare_kv_dtype):
        parser.error("--compare-attention, --compare-kernels, --compare-fusion, --compare-kv-dtype and --peers run on "
                     "the CPU only")
    if args.model and args.peers:
        parser.error("--peers compares the bundled model only (transformers loads its GGUF)")
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(args.model)
    prepared = PreparedCache(default_directory())
    model = load_model(checkpoint, "w8a8", device=device, kernel=choose_kernel(device), prepared_cache=prepared)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} threads"
    print(f"{checkpoint.model_name} W8A8 on {device} ({where}), kernel {model.kernel}, attention {model.attention}, "
          f"median of {args.repeats} round-robin repeats")
    if args.contexts:
        print_step_costs(model, args.contexts, args.trees, args.batches, args.repeats)
    context = args.contexts[0] if args.contexts else 512
    if args.compare_attention:
        engines = {f"{model.kernel} + {attention} attention": (model.kernel, attention, True)
                   for attention in ("native", "fp64")}
        print_engine_comparison(checkpoint, engines, context, args.trees, args.repeats, model, prepared)
    if args.compare_kernels:
        kernels = [k for k, usable in (("native", native_is_exact()), ("int_mm", int_mm_is_exact("cpu"))) if usable]
        engines = {f"{kernel} GEMM + native attention": (kernel, "native", True) for kernel in kernels}
        print_engine_comparison(checkpoint, engines, context, args.trees, args.repeats, model, prepared)
    if args.compare_fusion:
        engines = {f"{model.kernel} + native attention, layers {how}": (model.kernel, "native", how == "fused")
                   for how in ("fused", "as modules")}
        print_engine_comparison(checkpoint, engines, context, args.trees, args.repeats, model, prepared)
    if args.compare_kv_dtype:
        engines = {f"{model.kernel} + native attention, {name} KV cache": (model.kernel, "native", True, dtype)
                   for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        for context in args.contexts or [512]:
            print_engine_comparison(checkpoint, engines, context, args.trees, args.repeats, model, prepared)
    if args.throughput:
        print_throughput(model, checkpoint, args.sessions, args.new_tokens)
    if args.peers:
        print_peers(model, checkpoint, args.new_tokens, args.prompts)


if __name__ == "__main__":
    main()
