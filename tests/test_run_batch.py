"""`pardec run-batch` (gateway/cli_batch.py): OpenAI's batch format through a gateway's real HTTP
API. Answers come back one line per request in the input's order, each as a direct call gives
it; a refused request keeps its 400 and error body, and the others are not lost; a bad input is
refused whole, naming its lines, before anything is sent; a gateway that is not there leaves
each line an error."""

from __future__ import annotations

import doctest
import http.server
import json
import socket
import threading
import time

import pytest

from pardec.gateway import cli_batch
from pardec.gateway.cli import main
from tests.openai_front import model_of

QUESTION = "What is the capital of France? Answer in one word."


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(tmp_path, lines: list[str], url: str, *flags: str) -> tuple[int, list[dict]]:
    source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    code = main(["run-batch", "-i", str(source), "-o", str(sink), "--url", url, *flags])
    return code, [json.loads(line) for line in sink.read_text().splitlines()] if sink.exists() else []


def test_a_batch_is_answered_in_order_as_direct_calls_answer(front, client, tmp_path):
    assert doctest.testmod(cli_batch).failed == 0
    model = model_of(front)
    chat = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 12}
    direct = client.chat.completions.create(**chat).choices[0].message.content
    lines = [
        _line("chat", "/v1/chat/completions", chat),
        _line("refused", "/v1/chat/completions", {**chat, "temperature": -1}),
        _line("raw", "/v1/completions", {"model": model, "prompt": "The capital of France is", "temperature": 0,
                                         "max_tokens": 6}),
        _line("predicted", "/v1/chat/completions", {**chat, "prediction": {"type": "content", "content": direct}}),
        _line("messages", "/v1/messages", {"model": model, "max_tokens": 12, "temperature": 0,
                                           "messages": [{"role": "user", "content": QUESTION}]}),
    ]
    code, answers = _run(tmp_path, lines, f"http://{front.http_address}", "--concurrency", "3")
    assert code == 1  # one request was refused
    assert [a["custom_id"] for a in answers] == ["chat", "refused", "raw", "predicted", "messages"]
    assert [a["response"]["status_code"] for a in answers] == [200, 400, 200, 200, 200]
    assert all(a["error"] is None and a["id"].startswith("batch_req_") for a in answers)
    bodies = [a["response"]["body"] for a in answers]
    assert bodies[0]["choices"][0]["message"]["content"] == direct
    assert answers[0]["response"]["request_id"] == bodies[0]["id"]
    assert "temperature" in bodies[1]["error"]["message"]
    assert bodies[2]["choices"][0]["text"]
    assert bodies[3]["choices"][0]["message"]["content"] == direct  # lossless, drafted from the prediction
    assert bodies[3]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert bodies[4]["content"][0]["text"] == direct
    code, answers = _run(tmp_path, lines[:1], f"http://{front.http_address}")
    assert code == 0 and answers[0]["response"]["body"]["choices"][0]["message"]["content"] == direct


def test_a_bad_input_is_refused_whole_and_naming_its_lines(front, tmp_path, capsys):
    good = _line("a", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    lines = [good, "not json", good, _line("b", "/v1/embeddings", {}), _line("c", "/v1/completions", {"stream": True}),
             json.dumps({"custom_id": "d", "method": "GET", "url": "/v1/completions", "body": {}}), "[]"]
    code, answers = _run(tmp_path, lines, f"http://{front.http_address}")
    told = capsys.readouterr().err
    assert code == 2 and answers == []  # nothing was sent, no output written
    for number, named in ((2, "not JSON"), (3, 'custom_id: "a" is also line 1\'s'), (4, "url: must be one of"),
                          (5, "body.stream"), (6, 'method: must be "POST"'), (7, "must be a JSON object")):
        assert f"line {number}: {named}" in told, told


def test_inputs_that_are_not_requests_are_refused_plainly(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    for content, told in ((b"\xff\xfe not text\n", "--input: 'utf-8' codec"), (b"\n\n", "no requests"),
                          (b"[" * 100_000 + b"\n", "line 1: not JSON (nested too deeply)")):
        source.write_bytes(content)
        assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl")]) == 2
        assert told in capsys.readouterr().err
    for timeout in ("0", "nan", "inf", "-1"):
        with pytest.raises(SystemExit):
            main(["run-batch", "-i", str(source), "-o", "-", "--timeout", timeout])


def test_no_gateway_leaves_each_line_an_error_and_is_waited_for_once(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lines = [_line(f"q{i}", "/v1/completions", {"prompt": "x"}) for i in range(6)]
    lines[0] = "\ufeff" + lines[0]  # a byte order mark first is no line's business
    started = time.monotonic()
    code, answers = _run(tmp_path, lines, f"http://127.0.0.1:{port}/v1", "--timeout", "1", "--concurrency", "1")
    assert code == 1 and [a["custom_id"] for a in answers] == [f"q{i}" for i in range(6)]
    assert all(a["response"] is None and a["error"]["code"] == "connection_error" for a in answers)
    assert time.monotonic() - started < 5  # one wait of --timeout for the run, not one a request


def test_a_broken_answer_is_its_lines_error_and_loses_no_other_line(tmp_path):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if b"cut" in body:  # promises more than it sends
                self.send_header("Content-Length", "100")
                self.end_headers()
                self.wfile.write(b'{"id": ')
                return
            answer = json.dumps({"id": "cmpl-1", "choices": [{"text": "ok"}]}).encode()
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        lines = [_line("a", "/v1/completions", {"prompt": "x"}), _line("b", "/v1/completions", {"prompt": "cut"}),
                 _line("\ud800", "/v1/completions", {"prompt": "y"})]  # a lone surrogate: written escaped
        code, answers = _run(tmp_path, lines, f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert code == 1 and [a["custom_id"] for a in answers] == ["a", "b", "\ud800"]
    assert answers[0]["response"]["body"]["choices"][0]["text"] == "ok" and answers[2]["response"]["status_code"] == 200
    assert answers[1]["response"] is None and "IncompleteRead" in answers[1]["error"]["message"]
