"""The soak's arithmetic and report (bench/soak.py): RSS growth per process, the markdown table."""

from __future__ import annotations

import statistics


def rss_growth(samples: list[dict], fit_from: float) -> dict:
    """Per process: incarnations, first/last/max MiB, and MiB per minute by a least-squares line
    through its last incarnation's samples from ``fit_from`` on. A verifier's samples also carry
    its KV pool's pages ever handed out (pardec_verifier_kv_pool_touched_bytes): the pool is
    committed as sessions first reach its blocks, up to the most they held at once and never past
    kv_pool_tokens, so its growth is the pool warming up, not a leak; what is judged for a
    verifier is its RSS net of those pages (``judged_mib_per_min``), both are reported."""
    report = {}
    for name in sorted({n for s in samples for n in s if n != "t"}):
        points = [(s["t"], *s[name]) for s in samples if name in s]
        pids = list(dict.fromkeys(point[1] for point in points))
        window = [point for point in points if point[1] == pids[-1] and point[0] >= fit_from]
        growth = _slope([(t, mib) for t, _, mib, *_ in window])
        row = {"incarnations": len(pids), "first_mib": round(points[0][2], 1),
               "last_mib": round(points[-1][2], 1), "max_mib": round(max(point[2] for point in points), 1),
               "fit_from_s": window[0][0] if window else None, "growth_mib_per_min": growth,
               "pool_last_mib": None, "growth_net_of_pool_mib_per_min": None, "judged_mib_per_min": growth}
        pooled = [point for point in window if len(point) > 3]
        if pooled and len(pooled) == len(window):
            row["pool_last_mib"] = round(pooled[-1][3], 1)
            row["growth_net_of_pool_mib_per_min"] = row["judged_mib_per_min"] = _slope(
                [(t, mib - pool) for t, _, mib, pool in pooled])
        report[name] = row
    return report


def _slope(points: list[tuple[float, float]]) -> float | None:
    """MiB per minute by least squares; None under 5 points or 30 s."""
    if len(points) < 5 or points[-1][0] - points[0][0] < 30:
        return None
    return round(statistics.linear_regression(*zip(*points)).slope * 60, 3)


def markdown(result: dict) -> str:
    c, left, kinds = result["config"], result["left"], result["kinds"]
    lines = [f"# Soak: {c['minutes']} min, {c['in_flight']}-{c['in_flight_max']} requests in flight "
             f"({result['date']})", "", f"**{'PASSED' if result['passed'] else 'FAILED'}**: " + "; ".join(
                 f"{name} {'yes' if ok else 'NO'}" for name, ok in result["verdict"].items()), "",
             f"{result['requests']} requests in {result['load_s']} s over {result['prompts']} prompts "
             f"(max_new_tokens {c['max_new_tokens']}); a cut stream must be a prefix of plain decoding's output.", "",
             _row("kind", "requests", "statuses", "unexpected", "identical", "prefix", "mismatch", "p50 ms", "p99 ms"),
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    lines += [_row(kind, r["requests"], ", ".join(f"{s} {n}" for s, n in r["statuses"].items()), r["unexpected"],
                   r["identical"], r["prefix"], r["mismatch"], r["p50_ms"], r["p99_ms"])
              for kind, r in kinds.items()] + ["", _row("fault", "target", "at s", "back at s"), "|---|---|---:|---:|"]
    lines += [_row(f["fault"], f["target"], f["start_s"], f["end_s"]) for f in result["faults"]]
    lines += ["", f"Left once the load stopped (settled after {result['settled_s']} s; None: not within "
              f"{c['settle_s']} s): live sessions {left['sessions']}; Redis session keys {left['session_keys']}, "
              f"keys without a TTL {left['keys_without_ttl']}, memory keys (TTL'd) {left['memory_keys']}.", "",
              "Gateway counters: " + ", ".join(f"`{k}` {v:g}" for k, v in result["gateway_counters"].items()), "",
              _row("process", "incarnations", "first MiB", "last MiB", "max MiB", "growth MiB/min (second half)",
                   "KV pool MiB (last)", "growth net of the KV pool MiB/min"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_row(name, r["incarnations"], r["first_mib"], r["last_mib"], r["max_mib"], r["growth_mib_per_min"],
                   r["pool_last_mib"], r["growth_net_of_pool_mib_per_min"]) for name, r in result["rss"].items()]
    if result["unexpected"]:
        lines += ["", "Unexpected outcomes (first 30):", "", _row("t s", "kind", "status", "check", "detail", "faults"),
                  "|---:|---|---|---|---|---|"] + [_row(o["t"], o["kind"], o["status"], o["check"], o["detail"][:150],
                                                       ", ".join(o["faults"])) for o in result["unexpected"][:30]]
    return "\n".join(lines) + "\n"


def _row(*cells) -> str:
    return "| " + " | ".join("" if cell is None else str(cell) for cell in cells) + " |"


