"""`pardec up` starts the whole stack as processes; `pardec generate` gets real text from it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

PARDEC = [sys.executable, "-m", "pardec.gateway.cli"]


@pytest.fixture(scope="module", params=["2", "0"], ids=["drafter-replicas", "drafting-in-gateway"])
def running_stack(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("up")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    process = subprocess.Popen(
        [*PARDEC, "up", "--gateway-addr", "127.0.0.1:0", "--drafters", request.param, "--workdir", str(workdir)],
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
        process.kill()
        process.wait()


def test_pardec_generate_returns_real_text_with_stats(running_stack):
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
    assert reply["model"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"  # the bundled GGUF's general.name


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


def test_pardec_up_stops_cleanly_on_sigterm(running_stack):
    process, _, workdir = running_stack
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    # Every service it started (their command lines name the workdir) and Redis are gone.
    leftovers = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""
