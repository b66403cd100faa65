"""Text Generation Inference's API (gateway/tgi_api.py, http_tgi.py): a TGI body means the
completions request it names, checked on literal bodies; over HTTP, /generate gives
/v1/completions' text, details with each token, /generate_stream's token texts add up to it with
the details on the last event, errors are TGI's JSON (422 naming the parameter), /info describes
the served model."""

from __future__ import annotations

import http.client
import json
import re

import pytest

from pardec.gateway.tgi_api import completion_body, renamed
from pardec.runtime.errors import InvalidArgument
from tests.openai_front import model_of

PROMPT = "def fibonacci(n):"


def test_a_body_means_the_completions_request_it_names():
    greedy = completion_body({"inputs": "x", "parameters": {"max_new_tokens": 5, "seed": 3}}, plain=False)
    assert greedy == {"prompt": "x", "max_tokens": 5, "seed": 3, "temperature": 0.0,
                      "include_stop_str_in_output": True}  # TGI's text keeps the stop sequence
    # TGI's sampling: do_sample, or a parameter that changes the distribution; the seed drawn with is said.
    for parameters, temperature in (({"do_sample": True}, 1.0), ({"top_p": 0.9}, 1.0), ({"temperature": 0.7}, 0.7),
                                    ({"temperature": 1.0}, 0.0), ({"top_k": 0, "top_p": 1.0}, 0.0)):
        body = completion_body({"inputs": "x", "parameters": parameters}, False)
        assert body["temperature"] == temperature and (isinstance(body.get("seed"), int) == (temperature > 0))
    details = {"inputs": "x", "parameters": {"details": True, "top_n_tokens": 2}}
    assert completion_body(details, plain=True)["logprobs"] == 2  # each token's log-probability: plain decoding's
    assert completion_body({"inputs": "x"}, plain=True)["logprobs"] == 0
    assert "logprobs" not in completion_body({"inputs": "x", "parameters": {"details": True}}, plain=False)
    grammar = {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": {"type": "object"}}}}
    assert completion_body(grammar, False)["structured_outputs"] == {"json": {"type": "object"}}
    assert completion_body({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "a+"}}},
                           False)["structured_outputs"] == {"regex": "a+"}
    assert str(renamed(InvalidArgument("max_tokens: must be >= 1"))) == "parameters.max_new_tokens: must be >= 1"
    assert str(renamed(InvalidArgument("sampling.top_p: bad"))) == "parameters.top_p: bad"
    assert completion_body({"inputs": "x", "parameters": {"truncate": 10}}, False)["truncate_prompt_tokens"] == 10
    for bad in (-1, 0, "5", True):  # vLLM's -1 (the longest prompt) is not TGI's
        with pytest.raises(InvalidArgument, match=r"^parameters.truncate: must be an integer >= 1"):
            completion_body({"inputs": "x", "parameters": {"truncate": bad}}, False)
    assert str(renamed(InvalidArgument("truncate_prompt_tokens: must be"))) == "parameters.truncate: must be"


@pytest.mark.parametrize("body, message", [
    ({"inputs": ""}, "inputs: required"),
    ({"inputs": "x", "parameters": {"typical_p": 0.5}}, "parameters.typical_p: typical sampling"),
    ({"inputs": "x", "parameters": {"watermark": True}}, "parameters.watermark"),
    ({"inputs": "x", "parameters": {"best_of": 2}}, "parameters.best_of: must be 1"),
    ({"inputs": "x", "parameters": {"details": True, "top_n_tokens": 2}}, "parameters.top_n_tokens: with plain"),
    ({"inputs": "x", "parameters": {"temperature": 0}}, "parameters.temperature: must be strictly positive"),
    ({"inputs": "x", "parameters": {"grammar": {"type": "xml"}}}, "parameters.grammar: must be"),
    ({"inputs": "x", "parameters": []}, "parameters: must be an object"),
])
def test_what_is_not_served_is_refused_naming_the_parameter(body, message):
    with pytest.raises(InvalidArgument) as refused:
        completion_body(body, plain=False)
    assert str(refused.value).startswith(message), refused.value


def _post(front, path: str, body) -> tuple[int, bytes]:
    host, port = front.http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def _generate(front, **parameters):
    status, body = _post(front, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 24, **parameters}})
    assert status == 200, body
    return json.loads(body)


def test_generate_is_the_completions_text_with_details(front, client):
    completion = client.completions.create(model=model_of(front), prompt=PROMPT, max_tokens=24, temperature=0)
    text = completion.choices[0].text
    assert _generate(front) == {"generated_text": text}
    detailed = _generate(front, details=True)
    details = detailed["details"]
    assert detailed["generated_text"] == text and details["finish_reason"] == "length"
    assert details["generated_tokens"] == len(details["tokens"]) == completion.usage.completion_tokens
    assert all(token["logprob"] is None for token in details["tokens"])  # parallel decoding: none (MindIE's rule)
    plain = _generate(front, details=True, top_n_tokens=2, decoder_input_details=True, parallel_decoding=False,
                      return_full_text=True)
    assert plain["generated_text"] == PROMPT + text  # lossless, and the inputs in front
    tokens = plain["details"]["tokens"]
    assert [t["id"] for t in tokens] == [t["id"] for t in details["tokens"]] and all(t["logprob"] <= 0 for t in tokens)
    assert [len(top) for top in plain["details"]["top_tokens"]] == [2] * len(tokens)
    prefill = plain["details"]["prefill"]
    assert prefill[0]["logprob"] is None and all(t["logprob"] <= 0 for t in prefill[1:]) and len(prefill) > 3
    shaped = _generate(front, grammar={"type": "regex", "value": "[a-z]{3,8}"})
    assert re.fullmatch("[a-z]{3,8}", shaped["generated_text"]), shaped
    stop = text[4:7]  # TGI's text ends with the stop sequence it met
    stopped = _generate(front, stop=[stop], details=True)
    assert stopped["generated_text"].endswith(stop) and stopped["details"]["finish_reason"] == "stop_sequence"
    assert text.startswith(stopped["generated_text"][:-len(stop)])


def test_the_root_route_is_where_tgis_clients_post(front):
    whole = _generate(front)
    status, body = _post(front, "/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 24}})
    assert status == 200 and json.loads(body) == [whole]  # a list, as TGI's
    status, body = _post(front, "/", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 24}})
    events = [json.loads(line[len("data:"):]) for line in body.decode().split("\n\n") if line.strip()]
    assert status == 200 and events[-1]["generated_text"] == whole["generated_text"]
    status, body = _post(front, "/", {"inputs": PROMPT, "stream": True, "parameters": {"decoder_input_details": True}})
    assert status == 422 and json.loads(body)["error"].startswith("parameters.decoder_input_details")
    for route, body in (("/", {"inputs": PROMPT, "stream": True}), ("/generate_stream", {"inputs": PROMPT}),
                        ("/generate_stream", {"inputs": PROMPT, "parameters": None})):  # parameters are optional
        status, answer = _post(front, route, body)
        last = json.loads(answer.decode().strip().split("\n\n")[-1][len("data:"):])
        assert status == 200 and isinstance(last["generated_text"], str), (route, body, answer[-300:])


def test_generate_stream_adds_up_to_the_text_with_the_details_last(front):
    whole = _generate(front, details=True)
    status, body = _post(front, "/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 24}})
    assert status == 200
    lines = [line for line in body.decode().split("\n\n") if line.strip()]
    assert all(line.startswith("data:") for line in lines) and "[DONE]" not in body.decode()
    events = [json.loads(line[len("data:"):]) for line in lines]
    assert [event["index"] for event in events] == list(range(1, len(events) + 1))
    assert [event["token"]["id"] for event in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert "".join(event["token"]["text"] for event in events) == whole["generated_text"]
    assert all(event["generated_text"] is None for event in events[:-1])
    assert events[-1]["generated_text"] == whole["generated_text"]
    assert events[-1]["details"]["finish_reason"] == "length" and events[-1]["details"]["generated_tokens"] == 24


def test_errors_are_tgis_and_info_describes_the_model(front, client):
    status, body = _post(front, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 0}})
    assert status == 422 and json.loads(body) == {
        "error": json.loads(body)["error"], "error_type": "validation"}
    assert json.loads(body)["error"].startswith("parameters.max_new_tokens")
    status, body = _post(front, "/generate", {"inputs": PROMPT, "parameters": {"temperature": -1}})
    assert status == 422 and json.loads(body)["error"].startswith("parameters.temperature")
    status, body = _post(front, "/generate_stream", {"inputs": PROMPT, "parameters": {"typical_p": 0.2}})
    assert status == 422 and "typical_p" in json.loads(body)["error"]
    host, port = front.http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("GET", "/info")
    info = json.loads(connection.getresponse().read())
    connection.close()
    assert info["model_id"] == model_of(front) and info["max_total_tokens"] > info["max_input_tokens"] > 0
    assert info["max_best_of"] == 1 and info["router"] == "pardec"
