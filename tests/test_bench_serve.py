"""`pardec bench serve`: the stream's arithmetic on literal lines, the arrival schedule, the
summary's figures, and whole runs against a real gateway's HTTP API on loopback."""

from __future__ import annotations

import contextlib
import doctest
import http.server
import json
import math
import socket
import statistics
import threading
import time

import pytest

import pardec.bench.arrivals
import pardec.bench.endpoint_client
import pardec.bench.serve_options
from pardec.bench.arrivals import arrival_offsets
from pardec.bench.endpoint_client import Outcome, StreamReader, Target, body, send
from pardec.bench.serve import RANDOM_TOKENS, check_identical, load_prompts, main, random_prompts, summarize
from pardec.bench.serve_options import parse_goodput, redacted


def test_docstring_examples():
    for module in (pardec.bench.arrivals, pardec.bench.endpoint_client, pardec.bench.serve_options):
        assert doctest.testmod(module).failed == 0


def _read(lines: list[tuple[bytes, float]], sent_at: float = 0.0, ended_at: float | None = None) -> Outcome:
    """The outcome of a stream of ``lines``, each `data:` line an event of its own (a blank line after it)."""
    reader = StreamReader(sent_at)
    for raw, at in lines:
        if reader.line(raw, at) or (raw.startswith(b"data:") and reader.line(b"", at)):
            break
    return reader.outcome(ended_at if ended_at is not None else lines[-1][1])


def test_stream_reader_times_chunks_with_text_only():
    outcome = _read([
        (b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}', 0.1),  # no text: not the first token
        (b": a comment", 0.15),
        (b'data: {"choices": [{"delta": {"reasoning_content": "Hm"}}]}', 0.2),
        (b'data: {"choices": [{"delta": {"content": "A"}}]}', 0.5),
        (b'data: {"choices": [{"delta": {"tool_calls": [{"index": 0}]}, "finish_reason": "tool_calls"}]}', 0.6),
        (b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5,'
         b' "pardec": {"steps": 2, "decoding_method": "memory_decoding"}}}', 0.6),
        (b"data: [DONE]", 0.7),
    ])
    assert outcome.ok and outcome.ttft_s == 0.2 and outcome.e2e_s == 0.7
    assert [round(g, 6) for g in outcome.chunk_gaps_s] == [0.3, 0.1]
    assert (outcome.chunks, outcome.prompt_tokens, outcome.output_tokens, outcome.steps) == (3, 4, 5, 2)
    assert outcome.text == "A" and outcome.finish_reason == "tool_calls" and outcome.token_ids is None
    assert outcome.decoding_method == "memory_decoding" and outcome.tpot_s == pytest.approx((0.7 - 0.2) / 4)


def test_stream_reader_events_as_sse_says():
    reader = StreamReader(0.0)
    for raw in (b'data: {"choices": [{"text": "a",\r\n', b'data: "token_ids": [4]}]}\r\n', b"\r\n"):
        assert reader.line(raw, 1.0) is False  # one event over two data lines, CRLF endings
    assert reader.line(b"data: [DONE]\n", 2.0) is True  # the end: nothing after it is read
    outcome = reader.outcome(2.0)
    assert outcome.ok and (outcome.text, outcome.token_ids, outcome.ttft_s) == ("a", [4], 1.0)
    # a second choice (n > 1) is not mixed into the first's; values of the wrong type are not read
    mixed = _read([(b'data: {"choices": [{"index": 1, "text": "b"}, {"index": 0, "text": "a"}]}', 1.0),
                   (b'data: {"choices": [{"delta": {"content": ["x"]}, "token_ids": ["y"]}, "z"]}', 1.5),
                   (b"data: [DONE]", 2.0)])
    assert mixed.ok and mixed.text == "a" and mixed.chunks == 1 and mixed.token_ids is None


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
    listed = _read([(b"data: [1, 2]", 1.0), (b"data: [DONE]", 1.0)])
    assert not listed.ok and listed.error.startswith("a chunk that is not a JSON object")


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
    assert summary["tokens_per_chunk"] == round(32 / 22, 3) and summary["tokens_per_step"] == 30 / 15  # each answer's first token came from the prefill
    assert summary["goodput"] == 0.25  # only the first meets TTFT <= 200 ms
    one, uncounted = _outcome(0.1, 0.1, 1), _outcome(0.1, 0.5, 1)
    uncounted.output_tokens = None  # a server that sends neither usage nor token ids
    summary = summarize([one, uncounted], duration_s=1.0, percentiles=[50], slo={"tpot": 1000})
    assert summary["goodput"] == 1.0 and summary["uncounted"] == 1  # a one-token answer has no TPOT to miss


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
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert main(["--base-url", f"http://127.0.0.1:{port}"]) == 2
    assert f"cannot reach http://127.0.0.1:{port}" in capsys.readouterr().err
    # the warm-up's failures count: it is the reference, and a refusal there is a refusal
    assert main(base[:-2] + ["--compare-plain", "--rounds", "1", "--out", str(tmp_path / "compared")]) == 1
    compared = json.loads((tmp_path / "compared" / "results.json").read_text())
    assert compared["warmup"]["failed"] == 1 and compared["arms"]["parallel"]["failed"] == 1
    assert compared["identical"] == {"identical": 2, "different": 0, "where": []} and compared["warnings"] == []


@pytest.mark.parametrize("flags, rule", [
    (["--api", "sk-1"], "unrecognized arguments: --api"),  # no abbreviations: the key is found to leave out
    (["--extra-body", "[1]"], "--extra-body: must be a JSON object"),
    (["--extra-body", '{"n": 2, "stream": false}'], "--extra-body: n, stream are set by the benchmark"),
    (["--compare-plain", "--extra-body", '{"parallel_decoding": true}'], "--extra-body: parallel_decoding are set"),
    (["--base-url", "http://user:pw@127.0.0.1:8000"], "--base-url: must not hold credentials"),
    (["--base-url", "http://127.0.0.1:99999"], "--base-url: Port out of range"),
    (["--base-url", "ftp://127.0.0.1"], "--base-url: must be http(s)://"),
    (["--timeout-s", "inf"], "--timeout-s: must be a number of seconds"),
    (["--base-url", "https://127.0.0.1:1", "--tls-ca", "/nonexistent.pem"], "--tls-ca /nonexistent.pem: "),
    (["--api-key", "two words"], "--api-key: must be visible ASCII"),
    (["--goodput", "itl:5"], "--goodput 'itl:5': the metric must be one of"),
    (["--request-rate", "0"], "--request-rate: must be > 0"),
    (["--percentiles", "50,100"], "--percentiles: must be numbers in (0, 100)"),
    (["--temperature", "nan"], "--temperature: must be a finite number"),
])
def test_flags_refused_before_anything_is_sent(flags, rule, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--base-url", "http://127.0.0.1:1", *flags])
    assert exit_.value.code == 2 and rule in capsys.readouterr().err


def test_the_key_is_left_out_of_what_is_written():
    assert redacted(["--base-url", "u", "--api-key", "sk-9", "--extra-body", '{"note": "sk-9"}'], "sk-9") == [
        "--base-url", "u", "--api-key", "<redacted>", "--extra-body", '{"note": "<redacted>"}']


def test_the_pardec_command_runs_it(capsys):
    from pardec.gateway.cli import main as pardec

    with pytest.raises(SystemExit) as exit_:
        pardec(["bench", "serve", "--help"])
    assert exit_.value.code == 0 and "usage: pardec bench serve" in capsys.readouterr().out


def test_a_request_ends_at_its_time_limit_however_the_server_trickles():
    """A server that keeps a stream open with comments forever: the request fails at --timeout-s
    (a limit on the whole request, not on each read), and the run goes on."""

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 -- http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(100):
                    self.wfile.write(b": still here\n\n")
                    self.wfile.flush()
                    time.sleep(0.05)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = Target(f"http://127.0.0.1:{server.server_address[1]}", model="m", timeout_s=0.4)
        started = time.perf_counter()
        outcome = send(target, body(target, "hi", 4, {}))
        assert time.perf_counter() - started < 2.5
        assert not outcome.ok and outcome.error == "no end within --timeout-s 0.4"
    finally:
        server.shutdown()
        server.server_close()


def test_random_prompts_against_a_real_gateway(front, tmp_path):
    """vLLM's random dataset: token ids on completions (exactly the length asked), words on chat."""
    ids = random_prompts(3, 40, "completions", seed=5)
    assert ids == random_prompts(3, 40, "completions", seed=5) != random_prompts(3, 40, "completions", seed=6)
    assert all(len(p.text) == 40 and all(t in RANDOM_TOKENS for t in p.text) for p in ids)
    words = random_prompts(2, 40, "chat", seed=5)
    assert all(isinstance(p.text, str) and len(p.text.split()) == 30 for p in words)
    out = tmp_path / "random"
    assert main(["--base-url", f"http://{front.http_address}", "--endpoint", "completions", "--workload", "random",
                 "--random-input-len", "40", "--num-prompts", "2", "--max-tokens", "4", "--ignore-eos",
                 "--out", str(out)]) == 0
    served = json.loads((out / "results.json").read_text())["arms"]["served"]
    assert served["input_tokens"] == 80 and served["output_tokens"] == 8
