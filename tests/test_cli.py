"""`pardec up` starts the whole stack as processes; `pardec generate` gets real text from it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

PARDEC = [sys.executable, "-m", "pardec.gateway.cli"]
SERVED_NAME = "smollm2-135m"  # pardec up --served-model-name (MindIE's modelName)
# pardec up --chat-template: SmolLM2's own, its default system message another.
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are Pardec, a test assistant.<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def collector():
    """An OpenTelemetry collector (OTLP/gRPC) on loopback: the spans it received, its address."""
    from pardec.runtime.serving import start_server
    from tests.test_tracing import Collector

    received = Collector()
    server, address = start_server([received.add_to], "127.0.0.1:0")
    yield received, address
    server.stop(None)


@pytest.fixture(scope="module", params=["2", "0"], ids=["drafter-replicas", "drafting-in-gateway"])
def running_stack(request, tmp_path_factory, collector):
    """Two drafter replicas; or drafting in the gateway, with the verifier's prefix cache off, a
    bf16 KV cache, tracing, and the model served under a name of its own, with a chat template of
    its own."""
    workdir = tmp_path_factory.mktemp("up")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    template = workdir / "template.jinja"
    template.write_text(TEMPLATE)
    in_gateway = ["--no-prefix-caching", "--kv-cache-dtype", "bfloat16", "--served-model-name", SERVED_NAME,
                  "--chat-template", str(template), "--otlp-traces-endpoint", collector[1], "--max-model-len", "2400"]
    process = subprocess.Popen(
        [*PARDEC, "up", "--gateway-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--drafters", request.param,
         "--workdir", str(workdir), *(in_gateway if request.param == "0" else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines = []
    deadline = time.monotonic() + 300
    address = None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"pardec is up: gateway on (\S+)", line)
        if match:
            address = match.group(1)
            break
    assert address, "pardec up did not come up:\n" + "".join(lines)
    yield process, address, workdir
    if process.poll() is None:
        # SIGTERM first: `pardec up` stops its children (Redis among them); SIGKILL would orphan them.
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_pardec_generate_returns_real_text_with_stats(running_stack, request):
    _, address, _ = running_stack
    result = subprocess.run(
        [*PARDEC, "generate", "--addr", address, "--json", "--max-new-tokens", "40",
         "Write a Python function that adds two numbers."],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert "def " in reply["text"]
    assert reply["stats"]["decoding_method"] == "memory_decoding"
    assert int(reply["stats"]["steps"]) >= 1 and len(reply["token_ids"]) > 0

    plain = subprocess.run(
        [*PARDEC, "generate", "--addr", address, "--plain", "--max-new-tokens", "40",
         "Write a Python function that adds two numbers."],
        capture_output=True, text=True, timeout=300,
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == reply["text"].strip()
    assert f"[{reply['model']}, plain]" in plain.stderr and "tok/s" in plain.stderr
    in_gateway = request.node.callspec.params["running_stack"] == "0"
    assert reply["model"] == (SERVED_NAME if in_gateway else "Smollm2 135M 8k Lc100K Mix1 Ep2")  # else general.name


def test_pardec_generate_sends_a_conversation_or_a_raw_completion(running_stack, tmp_path):
    _, address, _ = running_stack

    def generate(*flags):
        result = subprocess.run([*PARDEC, "generate", "--addr", address, "--json", "--max-new-tokens", "8", *flags],
                                capture_output=True, text=True, timeout=300)
        return result.returncode, json.loads(result.stdout) if result.returncode == 0 else result.stderr

    conversation = tmp_path / "chat.json"
    conversation.write_text(json.dumps([{"role": "user", "content": "What is the capital of France?"},
                                        {"role": "assistant", "content": "Paris."}]))
    code, alone = generate("And of Italy?")
    assert code == 0, alone
    code, chat = generate("--system", "Be brief.", "--messages", str(conversation), "And of Italy?")
    assert code == 0, chat
    # The system message replaces SmolLM2's default one; the two earlier turns come before.
    assert int(chat["stats"]["prompt_tokens"]) > int(alone["stats"]["prompt_tokens"])
    code, raw = generate("--raw", "And of Italy?")
    assert code == 0 and int(raw["stats"]["prompt_tokens"]) < int(alone["stats"]["prompt_tokens"])
    conversation.write_text(json.dumps([{"role": "bot", "content": "Hi"}]))
    assert generate("--messages", str(conversation), "Hi")[0] == 2
    code, details = generate("--messages", str(conversation.with_name("absent.json")), "Hi")
    assert code == 2 and "--messages" in details
    code, details = generate("--raw", "--system", "Be brief.", "Hi")
    assert code == 1 and "INVALID_ARGUMENT" in details and "raw" in details


def test_pardec_generate_reports_errors_with_their_status(running_stack):
    _, address, _ = running_stack
    result = subprocess.run(
        [*PARDEC, "generate", "--addr", address, "--max-new-tokens", "100000000", "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "max_new_tokens" in result.stderr


def test_pardec_generate_prints_each_tokens_logprob(running_stack):
    _, address, _ = running_stack
    flags = [*PARDEC, "generate", "--addr", address, "--plain", "--max-new-tokens", "6", "--logprobs", "2"]
    shown = subprocess.run([*flags, "--stream", "Say hi."], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    table = shown.stdout.split("token\tlogprob\tlikeliest\n")[1].splitlines()
    assert len(table) == 6 and all(len(line.split("\t")) == 3 and ", " in line for line in table)
    reply = json.loads(subprocess.run([*flags, "--json", "Say hi."], capture_output=True, text=True, timeout=300).stdout)
    assert len(reply["logprobs"]) == 6 and all(len(lp["top_token_ids"]) == 2 for lp in reply["logprobs"])
    refused = subprocess.run([*PARDEC, "generate", "--addr", address, "--logprobs", "1", "hi"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 1 and "logprobs" in refused.stderr  # parallel decoding: MindIE's rule


def test_pardec_generate_holds_the_answer_to_a_language_and_away_from_bad_words_and_reads_a_prediction(running_stack, tmp_path):
    _, address, _ = running_stack
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
                                  "required": ["capital"], "additionalProperties": False}))
    flags = [*PARDEC, "generate", "--addr", address, "--max-new-tokens", "32"]
    shaped = subprocess.run([*flags, "--json-schema", str(schema), "What is the capital of France?"],
                            capture_output=True, text=True, timeout=300)
    assert shaped.returncode == 0, shaped.stderr
    assert set(json.loads(shaped.stdout.strip())) == {"capital"}
    chosen = subprocess.run([*flags, "--choice", "Paris", "--choice", "Rome", "What is the capital of France?"],
                            capture_output=True, text=True, timeout=300)
    assert chosen.stdout.strip() in ("Paris", "Rome"), chosen.stderr
    asked = [*flags, "--json", "What is the capital of France? Answer in one word."]
    free = json.loads(subprocess.run(asked, capture_output=True, text=True, timeout=300).stdout)["text"]
    banned = subprocess.run([*asked, "--bad-word", "Paris", "--thinking-budget", "16"], capture_output=True,
                            text=True, timeout=300)  # SmolLM2 does not think: the budget bounds nothing
    assert "Paris" in free and banned.returncode == 0 and "Paris" not in json.loads(banned.stdout)["text"], banned
    refused = subprocess.run([*asked, "--thinking-budget", "-1"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--thinking-budget" in refused.stderr
    predicted = tmp_path / "predicted.txt"
    predicted.write_text(free)
    followed = subprocess.run([*asked, "--prediction-file", str(predicted)], capture_output=True, text=True, timeout=300)
    reply = json.loads(followed.stdout)
    assert reply["text"] == free and reply["stats"]["accepted_prediction_tokens"] > 0, followed.stderr


def test_pardec_generate_offers_tools_and_sends_their_results_back(running_stack, tmp_path):
    _, address, _ = running_stack
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]))
    flags = [*PARDEC, "generate", "--addr", address, "--max-new-tokens", "40", "--tools", str(tools)]
    ask = "What is the weather in Paris?"
    forced = subprocess.run([*flags, "--tool-choice", "get_weather", "--json", ask], capture_output=True, text=True,
                            timeout=300)
    assert forced.returncode == 0, forced.stderr
    call = json.loads(forced.stdout)["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    shown = subprocess.run([*flags, "--tool-choice", "required", "--one-tool-call", "--stream", ask],
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^\[tool call call_\w+\] get_weather\(\{.*\}\)$", shown.stdout, re.M), shown.stdout
    # The call and its result go back as a conversation; the model answers in text.
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([{"role": "user", "content": ask},
                                        {"role": "assistant", "content": None, "tool_calls": [call]},
                                        {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"}]))
    answer = subprocess.run([*flags, "--messages", str(conversation), "--json"], capture_output=True, text=True,
                            timeout=300)
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["text"]
    # Refusals: the file's shape here (2), the gateway's rules naming the field (1).
    tools.write_text(json.dumps({"name": "get_weather"}))
    assert subprocess.run([*flags, ask], capture_output=True, text=True, timeout=120).returncode == 2
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "get weather"}}]))
    refused = subprocess.run([*flags, ask], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "INVALID_ARGUMENT: tools[0].function.name" in refused.stderr


def test_pardec_chat_keeps_the_conversation(running_stack):
    _, address, _ = running_stack
    turns = "What is the capital of France?\nAnd of Italy?\n/bogus\n/reset\nAnd of Italy?\n"
    result = subprocess.run([*PARDEC, "chat", "--addr", address, "--max-new-tokens", "12"], input=turns,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    replies = result.stdout.splitlines()
    assert len(replies) == 3 and all(replies)
    # The second question follows the first answer; after /reset the same words stand alone.
    assert replies[1] != replies[2]
    assert "unknown command '/bogus'" in result.stderr and "(a new conversation)" in result.stderr
    assert result.stderr.count("memory_decoding") == 3
    alone = subprocess.run([*PARDEC, "generate", "--addr", address, "--max-new-tokens", "12", "--plain",
                            "And of Italy?"], capture_output=True, text=True, timeout=300)
    assert alone.stdout.strip() == replies[2].strip()
    failed = subprocess.run([*PARDEC, "chat", "--addr", address, "--max-new-tokens", "999999"], input="Hi\n",
                            capture_output=True, text=True, timeout=300)  # a refused turn: a script sees it
    assert failed.returncode == 1 and "error: INVALID_ARGUMENT: max_new_tokens" in failed.stderr


def test_pardec_info_and_generate_say_what_the_prefix_cache_did(running_stack, request):
    """`pardec up --no-prefix-caching` reaches the verifier; `pardec info` says whether it caches,
    and a --cache-salt of its own makes a fresh scope: the second request with it reuses the
    first's blocks, the first reuses none."""
    _, address, _ = running_stack
    caching = request.node.callspec.params["running_stack"] == "2"
    info = subprocess.run([*PARDEC, "info", "--addr", address], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    lines = dict(line.split(":", 1) for line in info.stdout.splitlines())
    assert lines["prefix caching"].strip() == ("on, blocks of 32 tokens" if caching else "off")
    assert lines["KV cache"].strip() == f"{'float32' if caching else 'bfloat16'} (attention native)"
    prompt = "Summarize in one line: " + "the quick brown fox jumps over the lazy dog, " * 8
    salt = f"salt-{time.monotonic_ns()}"
    cached = []
    for _ in range(2):
        result = subprocess.run([*PARDEC, "generate", "--addr", address, "--json", "--max-new-tokens", "4",
                                 "--cache-salt", salt, prompt], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        stats = json.loads(result.stdout)["stats"]
        cached.append(int(stats.get("cached_prompt_tokens", 0)))
    assert int(stats["prompt_tokens"]) > 96
    assert cached[0] == 0 and (cached[1] >= 64 if caching else cached[1] == 0)
    summary = subprocess.run([*PARDEC, "generate", "--addr", address, "--max-new-tokens", "4", "--cache-salt", salt,
                              prompt], capture_output=True, text=True, timeout=300)
    assert re.search(r"\d+/\d+ prompt tokens cached", summary.stderr), summary.stderr
    if not caching:  # this stack traces: its gateway's and verifier's spans reach the collector
        received = request.getfixturevalue("collector")[0]
        deadline = time.monotonic() + 30  # spans leave in batches, every few seconds
        while time.monotonic() < deadline and {"pardec-gateway", "pardec-verifier"} - {s for s, _ in received.spans}:
            time.sleep(0.5)
        assert {"pardec-gateway", "pardec-verifier"} <= {service for service, _ in received.spans}


def test_pardec_up_serves_openai_clients_and_curl(running_stack, request):
    """The OpenAI SDK and curl hold a streamed multi-turn chat through `pardec up`, parallel
    decoding on, the text identical to plain decoding's and to the gRPC reply's."""
    import openai

    _, address, workdir = running_stack
    http = (workdir / "gateway-http.addr").read_text().strip()
    conversation = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "Write a Python function that adds two numbers."}]
    with openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id
        in_gateway = request.node.callspec.params["running_stack"] == "0"  # served with --max-model-len 2400
        assert client.models.list().data[0].model_extra["max_model_len"] == (2400 if in_gateway else 2560)
        with urllib.request.urlopen(f"http://{http}/info", timeout=60) as info:  # the gateway's limits too
            limits = json.loads(info.read())
        assert (limits["max_total_tokens"], limits["max_input_tokens"]) == ((2400, 2399) if in_gateway else (2560, 2048))
        for _turn in range(2):
            chunks = list(client.chat.completions.create(
                model=model, messages=conversation, max_tokens=40, temperature=0, stream=True,
                stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].usage.model_extra["pardec"]["decoding_method"] == "memory_decoding"
            body = json.dumps({"model": model, "messages": conversation, "max_tokens": 40, "temperature": 0,
                               "stream": True, "parallel_decoding": False})
            curl = subprocess.run(["curl", "-sS", "-N", f"http://{http}/v1/chat/completions", "-H",
                                   "Content-Type: application/json", "-d", body],
                                  capture_output=True, text=True, timeout=300)
            events = [line[6:] for line in curl.stdout.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            plain = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
            assert text and text == plain  # lossless
            conversation += [{"role": "assistant", "content": text},
                             {"role": "user", "content": "Now make it add three numbers."}]
    turns = workdir / "turns.json"
    turns.write_text(json.dumps(conversation[1:-1]))
    reply = subprocess.run([*PARDEC, "generate", "--addr", address, "--json", "--max-new-tokens", "40",
                            "--system", "You are a helpful assistant.", "--messages", str(turns),
                            "Now make it add three numbers."], capture_output=True, text=True, timeout=300)
    assert reply.returncode == 0, reply.stderr
    with openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0, timeout=300) as client:
        again = client.chat.completions.create(model=model, messages=conversation, max_tokens=40, temperature=0)
        assert json.loads(reply.stdout)["text"] == again.choices[0].message.content  # gRPC == HTTP
        # A raw completion, unary and streamed, equals gRPC's raw reply.
        whole = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=24, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt="def fibonacci(n):", max_tokens=24, temperature=0, stream=True) if c.choices)
    raw = subprocess.run([*PARDEC, "generate", "--addr", address, "--json", "--max-new-tokens", "24", "--raw",
                          "def fibonacci(n):"], capture_output=True, text=True, timeout=300)
    assert whole.choices[0].text == streamed == json.loads(raw.stdout)["text"]


def test_pardec_up_serves_its_chat_template(running_stack, request):
    """--chat-template: the verifiers serve it in place of the model's own; a template Jinja cannot
    parse, or a path naming no file, stops pardec up before anything starts (exit 2, naming it)."""
    import doctest

    import pardec.verifier.config

    assert doctest.testmod(pardec.verifier.config).failed == 0  # read_chat_template: a file or the text itself
    _, _, workdir = running_stack
    http = (workdir / "gateway-http.addr").read_text().strip()

    def post(path: str, body: dict) -> dict:
        ask = urllib.request.Request(f"http://{http}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(ask, timeout=60) as reply:
            return json.loads(reply.read())

    tokens = post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})["tokens"]
    prompt = post("/detokenize", {"tokens": tokens})["prompt"]
    assert ("You are Pardec, a test assistant." in prompt) == (request.node.callspec.params["running_stack"] == "0")
    for value, message in (("{% for x in %}", "chat_template: not a Jinja template"),
                           (str(workdir / "absent.jinja"), "chat_template: cannot read")):
        refused = subprocess.run([*PARDEC, "up", "--chat-template", value, "--workdir", str(workdir / "refused")],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr


def test_pardec_up_stops_cleanly_on_sigterm_and_fails_when_a_service_dies(running_stack):
    """SIGTERM: exit 0. A service killed (the one stack's verifier): the rest stopped, exit 1, so
    that what supervises pardec up (systemd's on-failure, a script) sees a failure."""
    process, _, workdir = running_stack
    if process.args[process.args.index("--drafters") + 1] == "2":
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    else:
        verifier = subprocess.run(["pgrep", "-f", f"pardec.verifier .*{workdir}"], capture_output=True, text=True)
        os.kill(int(verifier.stdout.split()[0]), signal.SIGKILL)
        assert process.wait(timeout=60) == 1
    # Every service it started (their command lines name the workdir) and Redis are gone.
    leftovers = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""


def test_vllm_names_of_pardec_ups_settings(tmp_path):
    """--host/--port say what --http-addr says; --max-model-len bounds maxSeqLen and maxInputTokenLen
    (a config file's smaller maxInputTokenLen stays); --api-key's refusals name it."""
    from argparse import Namespace

    from pardec.gateway.cli_up import _http_address
    from pardec.gateway.mindie import load_mindie_config
    from pardec.runtime.errors import ConfigError

    def address(**flags):
        return _http_address(Namespace(**{"host": None, "port": None, "http_addr": None, **flags}))

    assert address() == ("127.0.0.1:8000", False) and address(http_addr="") == (None, True)
    assert address(port=9000) == ("127.0.0.1:9000", True) and address(host="", port=0) == (":0", True)
    assert address(host="[::1]") == address(host="::1") == ("[::1]:8000", True)
    for flags, rule in (({"host": "0.0.0.0:8000"}, "--host: a host name or an address, without a port"),
                        ({"port": 70000}, "--port: must be in"),
                        ({"port": 8000, "http_addr": "127.0.0.1:8000"}, "give one or the other")):
        with pytest.raises(ConfigError, match=rule):
            address(**flags)
    embedded = load_mindie_config(None).bounded(4096)
    assert (embedded.max_seq_len, embedded.max_input_tokens) == (4096, 4095)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"ModelDeployConfig": {"maxSeqLen": 2560, "maxInputTokenLen": 1024}}))
    from_file = load_mindie_config(str(config)).bounded(4096, from_file=True)
    assert (from_file.max_seq_len, from_file.max_input_tokens) == (4096, 1024)
    refused = subprocess.run([*PARDEC, "up", "--api-key", "token-abc123", "--workdir", str(tmp_path / "refused")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--api-key: " in refused.stderr, refused.stderr
