"""`pardec bench serve`'s report: the arms' figures as a Markdown table, and parallel decoding
against plain decoding round by round (bench/serve.py runs them)."""

from __future__ import annotations

import math
import statistics

from pardec.bench.endpoint_client import Outcome

PARALLEL, PLAIN = "parallel", "plain"


def _ms(stats: dict | None, key: str) -> str:
    return "–" if not stats or stats.get(key) is None else f"{stats[key]:.1f}"


def markdown(result: dict) -> str:
    """The results as a Markdown table, the settings above it and the comparison below."""
    settings = result["settings"]
    top = f"p{max(settings['percentiles']):g}" if settings["percentiles"] else "median"
    lines = [f"`{result['command']}`", "",
             f"{result['model']} at {settings['base_url']} ({settings['endpoint']}), {settings['num_prompts']} requests "
             f"a run at {settings['request_rate']} req/s, at most {settings['max_concurrency'] or 'unlimited'} in "
             f"flight, {settings['rounds']} round(s), max_tokens {settings['max_tokens']}, temperature "
             f"{settings['temperature']}.", "",
             f"| arm | completed | failed | req/s | output tok/s | TTFT median / {top} ms | TPOT median / {top} ms "
             f"| ITL median / {top} ms | E2EL median / {top} ms | tokens per chunk | tokens per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, summary in result["arms"].items():
        pairs = [f"{_ms(summary[key], 'median')} / {_ms(summary[key], top)}"
                 for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")]
        lines.append(f"| {arm} | {summary['completed']} | {summary['failed']} | {summary['request_throughput']} | "
                     f"{summary['output_throughput']} | {' | '.join(pairs)} | {summary['tokens_per_chunk'] or '–'} | "
                     f"{summary['tokens_per_step'] or '–'} |")
    limits = next((s["goodput_limits_ms"] for s in result["arms"].values() if "goodput_limits_ms" in s), None)
    if limits:
        met = ", ".join(f"{key.upper()} <= {limit:g} ms" for key, limit in limits.items())
        rates = ", ".join(f"{arm} {summary['goodput']} req/s" for arm, summary in result["arms"].items())
        lines += ["", f"Goodput (requests a second that met {met}): {rates}."]
    comparison = result.get("comparison")
    if comparison:
        rounds = ", ".join(f"{r:.2f}x" for r in comparison["output_throughput_ratios"])
        lines += ["", f"Parallel over plain decoding, output tokens per second: **{comparison['speedup']:.2f}x** "
                      f"(the median of the rounds: {rounds}); TPOT {comparison['tpot_speedup']}x faster (median of "
                      f"the rounds' median TPOTs)."]
    check = result.get("identical")
    if check:
        lines += ["", f"Answers identical to the reference run's: {check['identical']} of "
                      f"{check['identical'] + check['different']}" + (f"; different: {check['where']}" if
                                                                     check["different"] else "") + "."]
    for arm, summary in result["arms"].items():
        for error, count in summary["errors"].items():
            lines.append(f"- {arm}: {count} x {error}")
    return "\n".join(lines) + "\n"


def _median_tpot(outcomes: list[Outcome]) -> float | None:
    values = [o.tpot_s for o in outcomes if o.ok and o.tpot_s is not None]
    return statistics.median(values) if values else None


def compare(runs: dict[str, list[tuple[list[Outcome], float]]]) -> dict:
    """Round by round, parallel over plain: output tokens per second, and TPOT (plain's over parallel's)."""
    ratios, tpot = [], []
    for (fast, fast_s), (slow, slow_s) in zip(runs[PARALLEL], runs[PLAIN]):
        made = [sum(o.output_tokens or 0 for o in outcomes if o.ok) for outcomes in (fast, slow)]
        if made[1] and fast_s and slow_s:
            ratios.append((made[0] / fast_s) / (made[1] / slow_s))
        times = _median_tpot(fast), _median_tpot(slow)
        if times[0] and times[1]:
            tpot.append(times[1] / times[0])
    return {"output_throughput_ratios": [round(r, 3) for r in ratios],
            "speedup": round(statistics.median(ratios), 3) if ratios else math.nan,
            "tpot_speedup": round(statistics.median(tpot), 3) if tpot else None}
