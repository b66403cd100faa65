"""What the HTTP API's tests share (tests/test_openai_http*.py); their `front` and `client`
fixtures are in conftest.py."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from typing import Any, Iterator

from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import RunningGateway, start_gateway
from pardec.runtime.serving import start_server
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model.tokenizer import ChatTokenizer
from pardec.verifier.service import VerifierServicer

TOKEN = "http-front-token-0123456789"


def gateway_config(stack, **extra) -> GatewayConfig:
    return GatewayConfig(verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"],
                         **extra)


def post_json(front, path: str, body: Any, timeout_s: float = 300) -> tuple[int, dict]:
    """(status, JSON reply) of a POST of ``body`` to ``front``'s HTTP API; an error status too."""
    request = urllib.request.Request(f"http://{front.http_address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def model_of(front) -> str:
    return front.generator.model.model_name


def with_template(tokenizer: ChatTokenizer, template: str) -> ChatTokenizer:
    """``tokenizer`` with another chat template."""
    return ChatTokenizer.from_parts(tokenizer.tokenizer_json, template, tokenizer.bos_token, tokenizer.eos_token,
                                    tokenizer.stop_token_ids)


@contextlib.contextmanager
def serving_template(stack, engine, template: str) -> Iterator[RunningGateway]:
    """The bundled model served with ``template`` (a verifier of its own on the shared model's
    weights), behind a gateway with its HTTP API."""
    config = VerifierConfig(measure_cost_curve=False, device=engine.config.device)
    served = Engine(engine.model, with_template(engine.tokenizer, template), engine.model_name, config)
    server, address = start_server([VerifierServicer(served).add_to], "127.0.0.1:0")
    running = start_gateway(GatewayConfig(verifier_target=address, drafter_target=stack.addresses["drafter"]),
                            "127.0.0.1:0", http_address="127.0.0.1:0")
    try:
        yield running
    finally:
        running.stop()
        server.stop(None)
        served.close()
