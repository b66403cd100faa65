"""`pardec bench serve`'s report: the arms' figures as a Markdown table, and parallel decoding
against plain decoding round by round (bench/serve.py runs them)."""

from __future__ import annotations

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
        rounds = ", ".join(_times(r) for r in comparison["output_throughput_ratios"])
        throughput, latency = _times(comparison["speedup"]), _times(comparison["e2el_speedup"])
        # At a fixed rate below the server's capacity, the arrivals set both arms' throughput.
        throughput, latency = (throughput, f"**{latency}**") if comparison["finite_rate"] else (
            f"**{throughput}**", latency)
        lines += ["", f"Parallel over plain decoding: output tokens per second {throughput} (the median of the "
                      f"rounds: {rounds}); median latency {latency} and median TPOT "
                      f"{_times(comparison['tpot_speedup'])} shorter (medians of the rounds' ratios)."]
    check = result.get("identical")
    if check:
        lines += ["", f"Answers identical to the reference run's: {check['identical']} of "
                      f"{check['identical'] + check['different']}" + (f"; different: {check['where']}" if
                                                                     check["different"] else "") + "."]
    for arm, summary in [*result["arms"].items(), ("plain warm-up", result.get("warmup", {"errors": {}}))]:
        for error, count in summary["errors"].items():
            lines.append(f"- {arm}: {count} x {error}")
        if summary.get("uncounted"):
            lines.append(f"- {arm}: {summary['uncounted']} answers with no usage and no token ids (no tokens counted)")
    lines += [f"- warning: {warning}" for warning in result.get("warnings", [])]
    return "\n".join(lines) + "\n"


def _median(outcomes: list[Outcome], measure) -> float | None:
    values = [value for value in (measure(o) for o in outcomes if o.ok) if value is not None]
    return statistics.median(values) if values else None


def _times(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}x"


def compare(runs: dict[str, list[tuple[list[Outcome], float]]], finite_rate: bool = False) -> dict:
    """Round by round, parallel over plain: output tokens per second, and how many times shorter
    the median TPOT and the median latency (E2EL) are. Below the server's capacity, at a fixed
    --request-rate, the arrivals set both arms' throughput; the latencies show the gain."""
    ratios, shorter = [], {"tpot": [], "e2el": []}
    for (fast, fast_s), (slow, slow_s) in zip(runs[PARALLEL], runs[PLAIN]):
        made = [sum(o.output_tokens or 0 for o in outcomes if o.ok) for outcomes in (fast, slow)]
        if made[1] and fast_s and slow_s:
            ratios.append((made[0] / fast_s) / (made[1] / slow_s))
        for key, measure in (("tpot", lambda o: o.tpot_s), ("e2el", lambda o: o.e2e_s)):
            times = _median(fast, measure), _median(slow, measure)
            if times[0] and times[1]:
                shorter[key].append(times[1] / times[0])
    return {"output_throughput_ratios": [round(r, 3) for r in ratios],
            "speedup": _rounded_median(ratios), "finite_rate": finite_rate,
            "tpot_speedup": _rounded_median(shorter["tpot"]), "e2el_speedup": _rounded_median(shorter["e2el"]),
            "tpot_ratios": [round(r, 3) for r in shorter["tpot"]], "e2el_ratios": [round(r, 3) for r in shorter["e2el"]]}


def _rounded_median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None
