"""What the HTTP API's tests share (tests/test_openai_http*.py); their `front` and `client`
fixtures are in conftest.py."""

from __future__ import annotations

from pardec.gateway.config import GatewayConfig

TOKEN = "http-front-token-0123456789"


def gateway_config(stack, **extra) -> GatewayConfig:
    return GatewayConfig(verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"],
                         **extra)


def model_of(front) -> str:
    return front.generator.model.model_name
