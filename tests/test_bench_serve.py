"""`pardec bench serve`: the stream's arithmetic on literal lines, the arrival schedule, the
summary's figures, and whole runs against a real gateway's HTTP API on loopback."""

from __future__ import annotations

import doctest
import json
import math
import statistics

import pytest

import pardec.bench.endpoint_client
import pardec.bench.serve
from pardec.bench.endpoint_client import Outcome, StreamReader
from pardec.bench.serve import arrival_offsets, check_identical, load_prompts, main, parse_goodput, summarize


def test_docstring_examples():
    assert doctest.testmod(pardec.bench.endpoint_client).failed == 0
    assert doctest.testmod(pardec.bench.serve).failed == 0


def _read(lines: list[tuple[bytes, float]], sent_at: float = 0.0, ended_at: float | None = None) -> Outcome:
    reader = StreamReader(sent_at)
    for raw, at in lines:
        reader.line(raw, at)
    return reader.outcome(ended_at if ended_at is not None else lines[-1][1])


def test_stream_reader_times_chunks_with_text_only():
    outcome = _read([
        (b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}', 0.1),  # no text: not the first token
        (b"", 0.1),
        (b": a comment", 0.15),
        (b'data: {"choices": [{"delta": {"reasoning_content": "Hm"}}]}', 0.2),
        (b'data: {"choices": [{"delta": {"content": "A"}}]}', 0.5),
        (b'data: {"choices": [{"delta": {"tool_calls": [{"index": 0}]}, "finish_reason": "tool_calls"}]}', 0.6),
        (b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5, "pardec": {"steps": 2}}}', 0.6),
        (b"data: [DONE]", 0.7),
    ])
    assert outcome.ok and outcome.ttft_s == 0.2 and outcome.e2e_s == 0.7
    assert [round(g, 6) for g in outcome.chunk_gaps_s] == [0.3, 0.1]
    assert (outcome.chunks, outcome.prompt_tokens, outcome.output_tokens, outcome.steps) == (3, 4, 5, 2)
    assert outcome.text == "A" and outcome.finish_reason == "tool_calls" and outcome.token_ids is None
    assert outcome.tpot_s == pytest.approx((0.7 - 0.2) / 4)


def test_stream_reader_completions_and_failures():
    text = _read([(b'data: {"choices": [{"text": "x", "token_ids": [7]}]}', 1.0), (b"data: [DONE]", 1.0)])
    assert text.ok and text.text == "x" and text.token_ids == [7] and text.output_tokens == 1 and text.tpot_s is None
    cut = _read([(b'data: {"choices": [{"text": "x"}]}', 1.0)])
    assert not cut.ok and cut.error == "the stream ended without [DONE]"
    refused = _read([(b'data: {"error": {"message": "max_tokens: too many", "code": 400}}', 1.0),
                     (b"data: [DONE]", 1.0)])
    assert not refused.ok and refused.error == "error in the stream: max_tokens: too many"
    garbled = _read([(b"data: {not json", 1.0), (b"data: [DONE]", 1.0)])
    assert not garbled.ok and garbled.error.startswith("a chunk that is not JSON")


def test_arrival_offsets():
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    assert arrival_offsets(50, 3.0, seed=7) == arrival_offsets(50, 3.0, seed=7) != arrival_offsets(50, 3.0, seed=8)
    poisson = arrival_offsets(4001, 5.0, seed=1)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert poisson[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = arrival_offsets(4001, 5.0, burstiness=0.25, seed=1)
    bursty_gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.mean(bursty_gaps) == pytest.approx(0.2, rel=0.1)
    assert statistics.stdev(bursty_gaps) / statistics.mean(bursty_gaps) == pytest.approx(2.0, rel=0.15)
    for rate, burstiness, flag in ((0.0, 1.0, "--request-rate"), (-1.0, 1.0, "--request-rate"),
                                   (1.0, 0.0, "--burstiness"), (1.0, math.inf, "--burstiness")):
        with pytest.raises(ValueError, match=flag):
            arrival_offsets(3, rate, burstiness)


def test_goodput_limits():
    assert parse_goodput(["ttft:500", "tpot:12.5"]) == {"ttft": 500.0, "tpot": 12.5}
    for bad, rule in (("itl:5", "must be one of"), ("ttft:x", "milliseconds"), ("ttft:0", "milliseconds"),
                      ("ttft", "milliseconds")):
        with pytest.raises(ValueError, match=rule):
            parse_goodput([bad])


def _outcome(ttft: float, e2e: float, tokens: int, gaps=(), ok=True, error="", ids=None) -> Outcome:
    return Outcome(ok=ok, error=error, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, prompt_tokens=10,
                   chunk_gaps_s=list(gaps), chunks=len(gaps) + 1, token_ids=ids, steps=tokens // 2 or None)


def test_summary_figures():
    outcomes = [_outcome(0.1, 1.1, 11, gaps=[0.1] * 10), _outcome(0.3, 2.3, 21, gaps=[0.2] * 10),
                _outcome(0, 0, 0, ok=False, error="HTTP 400: no")]
    summary = summarize(outcomes, duration_s=4.0, percentiles=[50, 99], slo={"ttft": 200, "tpot": 150})
    assert (summary["requests"], summary["completed"], summary["failed"]) == (3, 2, 1)
    assert summary["errors"] == {"HTTP 400: no": 1}
    assert (summary["output_tokens"], summary["input_tokens"]) == (32, 20)
    assert summary["request_throughput"] == 0.5 and summary["output_throughput"] == 8.0
    assert summary["ttft_ms"] == {"mean": 200.0, "median": 200.0, "p50": 200.0, "p99": 298.0}
    assert summary["tpot_ms"]["mean"] == 100.0  # (1.1 - 0.1) / 10 and (2.3 - 0.3) / 20
    assert summary["itl_ms"]["median"] == 150.0
    assert summary["tokens_per_chunk"] == round(32 / 22, 3) and summary["tokens_per_step"] == round(32 / 15, 3)
    assert summary["goodput"] == 0.25  # only the first meets TTFT <= 200 ms


def test_identical_answers():
    reference = [_outcome(0, 1, 2, ids=[1, 2]), _outcome(0, 1, 2, ids=[3, 4]), _outcome(0, 1, 0, ok=False)]
    same = [_outcome(0, 1, 2, ids=[1, 2]), _outcome(0, 1, 2, ids=[3, 4]), _outcome(0, 1, 2, ids=[5])]
    other = [_outcome(0, 1, 2, ids=[1, 2]), _outcome(0, 1, 2, ids=[3, 5]), _outcome(0, 1, 2, ids=[5])]
    assert check_identical(reference, {"a": same, "b": other}) == {"identical": 3, "different": 1,
                                                                   "where": [{"run": "b", "prompt": 1}]}


def test_prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "max_tokens": 3}\n')
    assert [(p.text, p.max_tokens) for p in load_prompts("code_edit", str(path), 3, 9, 0)] == [
        ("a", 9), ("b", 3), ("a", 9)]
    for line, rule in (('["a"]', 'non-empty "prompt"'), ('{"prompt": ""}', 'non-empty "prompt"'),
                       ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be"), ("{", "not JSON")):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=f"line 1: .*{rule}"):
            load_prompts("code_edit", str(path), 1, 9, 0)


def test_compare_plain_against_a_real_gateway(front, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["--base-url", f"http://{front.http_address}", "--workload", "code_edit", "--num-prompts", "3",
                 "--max-tokens", "24", "--max-concurrency", "2", "--request-rate", "20", "--compare-plain",
                 "--goodput", "e2el:600000", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    result = json.loads((out / "results.json").read_text())
    for arm in ("parallel", "plain"):
        summary = result["arms"][arm]
        assert (summary["completed"], summary["failed"], summary["errors"]) == (3, 0, {})
        assert summary["output_tokens"] > 0 and summary["ttft_ms"]["median"] > 0 and summary["goodput"] > 0
    assert result["arms"]["plain"]["tokens_per_step"] <= 1.05 and result["arms"]["parallel"]["tokens_per_step"] >= 1
    assert result["identical"] == {"identical": 6, "different": 0, "where": []}  # both arms against the warm-up
    assert result["comparison"]["speedup"] > 0 and len(result["comparison"]["output_throughput_ratios"]) == 1
    assert "Answers identical to the reference run's: 6 of 6." in (out / "results.md").read_text()
    assert "api_key" not in result["settings"]


def test_completions_rounds_and_refusals_against_a_real_gateway(front, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "x", "max_tokens": 100000}\n')
    base = ["--base-url", f"http://{front.http_address}/v1", "--endpoint", "completions", "--num-prompts", "2",
            "--max-tokens", "8", "--rounds", "2", "--prompts-file", str(prompts), "--out", str(tmp_path / "out")]
    assert main(base) == 1  # the second prompt is refused: reported, not raised
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    served = result["arms"]["served"]
    assert (served["completed"], served["failed"]) == (2, 2)
    [(error, count)] = served["errors"].items()
    assert count == 2 and error.startswith("HTTP 400: max_tokens: ") and "maxSeqLen" in error
    assert result["identical"]["identical"] == 1  # the first prompt's answer, the same in both rounds
    capsys.readouterr()
    assert main(base[:2] + ["--model", "not-this-one"]) == 1
    assert "the first request failed: HTTP 404: model: 'not-this-one'" in capsys.readouterr().err
    assert main(["--base-url", "http://127.0.0.1:9"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--extra-body", "[1]"])
    assert "--extra-body: must be a JSON object" in capsys.readouterr().err


def test_the_pardec_command_runs_it(capsys):
    from pardec.gateway.cli import main as pardec

    with pytest.raises(SystemExit) as exit_:
        pardec(["bench", "serve", "--help"])
    assert exit_.value.code == 0 and "usage: pardec bench serve" in capsys.readouterr().out
