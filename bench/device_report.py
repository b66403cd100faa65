"""bench.device's report as Markdown: the tables docs/device-h100.md quotes."""

from __future__ import annotations


def markdown(report: dict) -> str:
    lines = [f"# Device engine, {report['date']}: {report['gpu']}", "",
             f"torch {report['torch']}, triton {report['triton']}, mode {report['mode']}, "
             f"command `{report['command']}`", "", f"Attention tuning: `{report.get('attention_tuning', '')}`", ""]
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
        lines += ["", "**Attention tunings** (ms at 512 positions; the first is the default)", "",
                  "| tuning | 1 token | 64 tokens |", "|---|---:|---:|"]
        lines += [f"| {name} | {v.get('1x1', '')} | {v.get('64x1', '')} |" for name, v in report["attention_variants"].items()]
    if "decode_tokens_per_s" in report:
        lines += ["", "**Plain greedy decoding after the prompt, tokens/s** (one session, same GPU)", "",
                  "| | tokens/s |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in report["decode_tokens_per_s"].items()]
    return "\n".join(lines) + "\n"
