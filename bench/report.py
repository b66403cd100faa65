"""A benchmark cell's measurements, and its rows written as JSON, a Markdown table and PNG plots."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

# The mode name of the A/A rows (`pardec bench --control`): plain measured against plain.
CONTROL = "plain (A/A control)"


@dataclass
class Cell:
    """One workload x mode x concurrency measurement."""

    workload: str
    mode: str
    concurrency: int
    tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0
    accepted_drafts: int = 0
    draft_nodes: int = 0  # draft tokens verified, accepted or not
    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    decode_ms: float = 0.0  # every request's time after its first token, summed
    decode_tokens: int = 0  # every request's tokens after its first, summed
    identical: bool = True
    error: str = ""
    round_ratios: list[float] = field(default_factory=list)  # parallel / plain tok/s per round
    round_decode_ratios: list[float] = field(default_factory=list)  # plain / parallel TPOT per round
    outputs: dict = field(default_factory=dict)  # prompt -> token ids (plain cells)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT), pooled over the requests: the
        decoding phase alone, which drafting speeds up, without the prefill, which it does not."""
        return self.decode_ms / self.decode_tokens if self.decode_tokens else None

    def summary(self, plain: "Cell") -> dict:
        """This parallel cell's row, beside ``plain``, its plain twin of the same rounds."""
        def pct(values, q):
            return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else 0.0)

        return {
            "workload": self.workload, "mode": self.mode, "concurrency": self.concurrency,
            "tokens": self.tokens, "tokens_per_s": round(self.tokens_per_s, 2),
            "plain_tokens_per_s": round(plain.tokens_per_s, 2),
            "speedup_vs_plain": round(statistics.median(self.round_ratios), 3) if self.round_ratios else None,
            "round_ratios": [round(ratio, 3) for ratio in self.round_ratios],
            "tpot_ms": round(self.tpot_ms, 2) if self.tpot_ms else None,
            "plain_tpot_ms": round(plain.tpot_ms, 2) if plain.tpot_ms else None,
            "decode_speedup": round(statistics.median(self.round_decode_ratios), 3) if self.round_decode_ratios else None,
            # Over all requests' steps, as the peers count it: a mean of each request's own
            # mean would weigh a short, well-drafted request like a long, poorly drafted one.
            "mean_accepted_length": round(1 + self.accepted_drafts / self.steps, 3) if self.steps else None,
            "steps": self.steps,
            # What drafting cost: the draft nodes each step verified, and the share accepted.
            "draft_nodes_per_step": round(self.draft_nodes / self.steps, 2) if self.steps else None,
            "accepted_per_node": round(self.accepted_drafts / self.draft_nodes, 3) if self.draft_nodes else None,
            "ttft_ms_p50": round(statistics.median(self.ttft_ms), 1) if self.ttft_ms else None,
            "latency_ms_p50": round(pct(self.latency_ms, 50), 1) if self.latency_ms else None,
            "latency_ms_p99": round(pct(self.latency_ms, 99), 1) if self.latency_ms else None,
            "identical_to_plain": self.identical, "error": self.error or plain.error,
        }

COLUMNS = (
    ("workload", "workload"), ("mode", "mode"), ("concurrency", "conc."),
    ("plain_tokens_per_s", "plain tok/s"), ("tokens_per_s", "tok/s"), ("speedup_vs_plain", "speedup"),
    ("round_ratios", "rounds' range"), ("decode_speedup", "decode speedup"), ("plain_tpot_ms", "plain TPOT ms"),
    ("tpot_ms", "TPOT ms"), ("mean_accepted_length", "tokens/step"), ("steps", "steps"),
    ("draft_nodes_per_step", "nodes/step"), ("accepted_per_node", "accepted/node"), ("ttft_ms_p50", "TTFT p50 ms"),
    ("latency_ms_p50", "latency p50 ms"), ("latency_ms_p99", "p99 ms"), ("identical_to_plain", "identical"),
)


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['workload']} | {row['mode']} | {row['concurrency']} | error: {row['error']} |")
            continue
        cells = []
        for key, _ in COLUMNS:
            value = row.get(key)
            if key in ("speedup_vs_plain", "decode_speedup") and value is not None:
                value = f"{value:.2f}x"
            elif key == "round_ratios":
                value = f"{min(value):.2f}–{max(value):.2f}" if value else None
            elif key == "identical_to_plain":
                value = "yes" if value else "NO"
            cells.append("" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def peers_markdown(rows: list[dict], peers: list[dict]) -> str:
    """Peers next to pardec's own plain and best parallel mode at concurrency 1, same prompts."""
    if not peers:
        return ""
    lines = ["| workload | system | tok/s | tokens/step | vs pardec plain |", "|---|---|---:|---:|---:|"]
    for workload in dict.fromkeys(p["workload"] for p in peers):
        mine = [r for r in rows if r["workload"] == workload and r["concurrency"] == 1 and not r.get("error")
                and r["mode"] != CONTROL]
        plain = statistics.median(r["plain_tokens_per_s"] for r in mine) if mine else None
        entries: list[tuple] = [("pardec plain", plain, 1.0)]
        if mine:
            best = max(mine, key=lambda r: r["tokens_per_s"])
            entries.append((f"pardec {best['mode']}", best["tokens_per_s"], best["mean_accepted_length"]))
        entries += [(p["peer"], p["tokens_per_s"], p["tokens_per_step"], p.get("error"))
                    for p in peers if p["workload"] == workload]
        for name, tokens_per_s, per_step, *error in entries:
            ratio = f"{tokens_per_s / plain:.2f}x" if plain and tokens_per_s else ""
            speed = f"error: {error[0]}" if error and error[0] else "" if tokens_per_s is None else f"{tokens_per_s:.1f}"
            lines.append(f"| {workload} | {name} | {speed} | {'' if per_step is None else per_step} | {ratio} |")
    return "\n".join(lines) + "\n"


def write(rows: list[dict], out: Path, settings: dict, peers: list[dict] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"settings": settings, "rows": rows, "peers": list(peers)}, indent=2))
    text = markdown(rows) + ("\n" + peers_markdown(rows, list(peers)) if peers else "")
    (out / "results.md").write_text(text)
    _plots(rows, out)
    print(text)
    print(f"written to {out}/results.json, results.md, speedup.png, throughput.png")


def _plots(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if not r.get("error")]
    workloads = sorted({r["workload"] for r in good})
    modes = sorted({r["mode"] for r in good})
    low = min((r["concurrency"] for r in good), default=1)

    # End to end beside the decoding phase alone: the prefill, the same in both arms, is what
    # separates them.
    figure, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
    width = 0.8 / max(len(modes), 1)
    for axis, key, title in ((axes[0], "speedup_vs_plain", "end to end (tokens/s)"),
                             (axes[1], "decode_speedup", "decoding only (TPOT)")):
        for index, mode in enumerate(modes):
            values = [next((r.get(key) for r in good if r["workload"] == w and r["mode"] == mode
                            and r["concurrency"] == low), 0) or 0 for w in workloads]
            axis.bar([i + index * width for i in range(len(workloads))], values, width, label=mode)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(workloads))], workloads)
        axis.set_title(title)
    axes[0].set_ylabel(f"speedup vs plain (concurrency {low})")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "speedup.png", dpi=120)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(8, 4))
    for mode in (m for m in modes if m != CONTROL):  # its tok/s are plain's
        levels = sorted({r["concurrency"] for r in good if r["mode"] == mode})
        def mean_over_workloads(key, level, mode=mode):
            values = [r[key] for r in good if r["mode"] == mode and r["concurrency"] == level]
            return sum(values) / len(values)

        total = [mean_over_workloads("tokens_per_s", c) for c in levels]
        plain = [mean_over_workloads("plain_tokens_per_s", c) for c in levels]
        axis.plot(levels, total, marker="o", label=mode)
        axis.plot(levels, plain, marker="x", linestyle="--", label=f"plain (beside {mode})")
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("tokens/s, mean over workloads")
    axis.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in good})
    axis.set_xticks(levels, [str(level) for level in levels])
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "throughput.png", dpi=120)
    plt.close(figure)
