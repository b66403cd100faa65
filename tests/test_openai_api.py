"""OpenAI bodies <-> the core's Request and replies (gateway/openai_api.py), with literal bodies:
what each field becomes, what is refused and how the refusal names the field."""

from __future__ import annotations

import pytest

from pardec.gateway.chat import Message
from pardec.gateway.deadlines import Cancelled, DeadlineExceeded
from pardec.gateway.outputs import Chunk, Generation, Stats
from pardec.gateway.http_errors import error_body
from pardec.gateway.openai_api import chat_request, completion_request, http_field
from pardec.gateway.openai_replies import ChunkWriter, chat_response
from pardec.runtime.errors import InvalidArgument, NotFound, ResourceExhausted, Unauthenticated, Unavailable

MODEL = "m"
HI = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return chat_request({"model": MODEL, "messages": HI, **fields}, tenant="t", model_name=MODEL)


def test_fields_become_the_core_request():
    request = chat(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop="END",
                   repetition_penalty=1.1, n=1, user="u-1", parallel_decoding=False, session_id="s1",
                   draft={"decoding_length": 4})
    assert request.messages == (Message("user", "Hi"),) and not request.raw and request.prompt == ""
    assert request.max_new_tokens == 7 and request.plain and request.stop == ("END",) and request.n == 1
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed, sampling.repetition_penalty) == (
        0.5, 0.9, 40, 3, 1.1)
    assert request.session_id.endswith("/m/s1") and request.session_id.startswith("t/")  # scoped to the tenant
    assert request.draft.decoding_length == 4 and request.tenant == "t"


def test_openai_defaults_not_grpc_defaults():
    request = chat()
    assert request.sampling.temperature == 1.0 and request.sampling.top_p == 1.0 and request.sampling.top_k == 0
    assert request.max_new_tokens == 0 and not request.plain and request.stop == ()  # server default length
    assert chat(top_k=-1).sampling.top_k == 0  # vLLM's "no top-k"
    assert chat(max_completion_tokens=5, max_tokens=9).max_new_tokens == 5  # the newer name wins
    assert chat(temperature=1).sampling.temperature == 1.0  # an integer for a number field


def test_content_parts_and_roles():
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    request = chat_request({"messages": messages}, tenant="", model_name=MODEL)
    assert request.messages == (Message("system", "Be brief."), Message("user", "Hello"))


def test_completions_are_raw_and_take_one_prompt():
    request = completion_request({"model": MODEL, "prompt": ["def f():"], "max_tokens": 3}, "", MODEL)
    assert request.prompt == "def f():" and request.raw and request.messages == ()
    # Token ids (vLLM's, and lm-evaluation-harness's tokenized requests): alone or a batch of one.
    assert completion_request({"prompt": [1, 2, 3]}, "", MODEL).prompt_token_ids == (1, 2, 3)
    assert completion_request({"prompt": [[4, 5]]}, "", MODEL).prompt_token_ids == (4, 5)
    for prompt in ([[1], [2]], ["a", "b"], [1, "a"], [], [-1], 7, [True]):
        with pytest.raises(InvalidArgument, match=r"^prompt: must be"):
            completion_request({"prompt": prompt}, "", MODEL)
    with pytest.raises(InvalidArgument, match=r"^suffix: "):
        completion_request({"prompt": "x", "suffix": "y"}, "", MODEL)
    completion_request({"prompt": "x", "echo": False, "suffix": None}, "", MODEL)  # their off values pass
    # echo: the prompt's tokens are scored only with logprobs; chat does not echo.
    assert completion_request({"prompt": "x", "echo": True}, "", MODEL).prompt_logprobs is None
    assert completion_request({"prompt": "x", "echo": True, "logprobs": 3}, "", MODEL).prompt_logprobs == 3
    assert completion_request({"prompt": "x", "echo": True, "max_tokens": 0}, "", MODEL).max_new_tokens == 1
    with pytest.raises(InvalidArgument, match=r"^max_tokens: "):  # 0 only to score an echoed prompt
        completion_request({"prompt": "x", "max_tokens": 0}, "", MODEL)
    with pytest.raises(InvalidArgument, match=r"^echo: must be true or false"):
        completion_request({"prompt": "x", "echo": "yes"}, "", MODEL)
    with pytest.raises(InvalidArgument, match=r"^echo: only /v1/completions"):
        chat_request({"messages": HI, "echo": True}, "", MODEL)


@pytest.mark.parametrize("fields, error, field", [
    ({"temperature": "hot"}, InvalidArgument, "temperature"),
    ({"temperature": -1}, InvalidArgument, "temperature"),
    ({"temperature": True}, InvalidArgument, "temperature"),
    ({"top_p": 1.5}, InvalidArgument, "top_p"),
    ({"max_tokens": 0}, InvalidArgument, "max_tokens"),
    ({"max_tokens": 2.5}, InvalidArgument, "max_tokens"),
    ({"seed": -1}, InvalidArgument, "seed"),
    ({"stop": [1]}, InvalidArgument, "stop"),
    ({"repetition_penalty": 0}, InvalidArgument, "repetition_penalty"),
    ({"tools": [{"type": "function"}]}, InvalidArgument, "tools"),
    ({"tool_choice": "required"}, InvalidArgument, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, InvalidArgument, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}}, InvalidArgument,
     "response_format.json_schema.schema"),
    ({"guided_regex": "(a"}, InvalidArgument, "guided_regex"),
    ({"guided_choice": "yes"}, InvalidArgument, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, InvalidArgument, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, InvalidArgument,
     "response_format"),
    ({"logit_bias": {"1": 101}}, InvalidArgument, "logit_bias[1]"),
    ({"logit_bias": {"one": 5}}, InvalidArgument, "logit_bias"),
    ({"logit_bias": [1]}, InvalidArgument, "logit_bias"),
    ({"min_tokens": -1}, InvalidArgument, "min_tokens"),
    ({"allowed_token_ids": [-3]}, InvalidArgument, "allowed_token_ids"),
    ({"stream_options": {"include_usage": True}}, InvalidArgument, "stream_options"),
    ({"parallel_decoding": "no"}, InvalidArgument, "parallel_decoding"),
    ({"draft": {"level": "x"}}, InvalidArgument, "draft"),
    ({"session_id": 5}, InvalidArgument, "session_id"),
    ({"session_id": "has space"}, InvalidArgument, "session_id"),
    ({"top_k": 10**13}, InvalidArgument, "top_k"),
    ({"temperature": 1e300}, InvalidArgument, "temperature"),
    ({"stop": ["\ud800"]}, InvalidArgument, "stop[0]"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, InvalidArgument, "messages[0].content"),
    ({"model": "gpt-4o"}, NotFound, "model"),
    ({"messages": []}, InvalidArgument, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, InvalidArgument, "messages[0].tool_call_id"),
    ({"messages": [{"role": {"a": 1}, "content": "x"}]}, InvalidArgument, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "x"}]}, InvalidArgument, "messages[0].role"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, InvalidArgument, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, InvalidArgument,
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, InvalidArgument, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, InvalidArgument,
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": 1}, InvalidArgument,
     "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, InvalidArgument, "functions"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": {}}}]}]}, InvalidArgument, "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, InvalidArgument, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, InvalidArgument, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": None}]}, InvalidArgument, "messages[0].content"),
])
def test_refusals_name_the_field(fields, error, field):
    with pytest.raises(error) as caught:
        chat(**fields)
    assert str(caught.value).startswith(field)


def test_harmless_fields_pass_and_unknown_ones_are_logged(caplog):
    chat(user="x", store=False, metadata={}, response_format={"type": "text"}, tool_choice="none", tools=[])
    with caplog.at_level("INFO", logger="pardec.gateway.openai_api"):
        chat(frobnicate=1)
        chat(**{"x\n2026-11-26 ERROR forged": 1})
    assert "ignored unknown request fields: 'frobnicate'" in caplog.text
    assert "\n2026-11-26 ERROR forged" not in caplog.text  # a field's name cannot forge a log line


@pytest.mark.parametrize("message, param, renamed", [
    ("sampling.top_k: must be >= 0, got -3", "top_k", "top_k: must be >= 0, got -3"),
    ("max_new_tokens: prompt (9 tokens) + max_new_tokens (9000) exceeds maxSeqLen 2048", "max_tokens",
     "max_tokens: prompt (9 tokens) + max_new_tokens (9000) exceeds maxSeqLen 2048"),
    ("n = 2: must be 0 or 1: parallel decoding returns one sequence [MindIE]", "n",
     "n = 2: must be 0 or 1: parallel decoding returns one sequence [MindIE]"),
    ("messages[3].role: the conversation must end with a user message", "messages[3].role",
     "messages[3].role: the conversation must end with a user message"),
    ("the verifier is not reachable", "", "the verifier is not reachable"),
    # Names that are not a request's fields are not a param: a method's, a header's, a service's.
    ("ChatCompletions: the gateway is serving 1 calls", "", "ChatCompletions: the gateway is serving 1 calls"),
    ("authorization: the bearer token is not valid", "", "authorization: the bearer token is not valid"),
    ("verifier: no answer before the deadline", "", "verifier: no answer before the deadline"),
])
def test_core_messages_take_the_http_names(message, param, renamed):
    assert http_field(message) == (param, renamed)


@pytest.mark.parametrize("error, status, kind", [
    (InvalidArgument("n = 2: no"), 400, "invalid_request_error"),
    (Unauthenticated("authorization: missing"), 401, "authentication_error"),
    (NotFound("model: 'x' is not served"), 404, "not_found_error"),
    (ResourceExhausted("Generate: busy"), 429, "rate_limit_error"),
    (Unavailable("verifier down"), 503, "service_unavailable"),
    (DeadlineExceeded("the request's deadline passed"), 504, "timeout"),
    (Cancelled("gone"), 499, "cancelled"),
])
def test_errors_map_to_http_statuses_in_openai_json(error, status, kind):
    got_status, body = error_body(error)
    assert got_status == status and body["error"]["type"] == kind and body["error"]["code"] == error.status.name
    assert body["error"]["message"] == str(error)


def test_replies_and_chunks():
    stats = Stats(prompt_tokens=5, steps=2, draft_tokens=6, accepted_draft_tokens=3, decoding_method="memory_decoding")
    reply = chat_response(Generation("Hello!", [1, 2, 3], "eos", stats), MODEL, "chatcmpl-1", 100)
    assert reply["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                                   "logprobs": None, "finish_reason": "stop"}
    assert reply["usage"]["total_tokens"] == 8 and reply["usage"]["pardec"]["mean_accepted_length"] == 2.5
    writer = ChunkWriter(chat=True, model=MODEL, include_usage=True)
    first = writer.chunks(Chunk("Hel", [1]))
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "Hel"}]
    last = writer.chunks(Chunk("lo", [2, 3], "length", stats))
    assert last[0]["choices"][0] == {"index": 0, "delta": {"content": "lo"}, "logprobs": None,
                                     "finish_reason": "length"}
    assert last[1]["choices"] == [] and last[1]["usage"]["completion_tokens"] == 3
    assert len({c["id"] for c in first + last}) == 1 and last[0]["object"] == "chat.completion.chunk"
    plain = ChunkWriter(chat=False, model=MODEL, include_usage=False)
    assert [c["choices"][0]["text"] for c in plain.chunks(Chunk("x", [1], "stop", stats))] == ["x"]
