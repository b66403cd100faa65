"""Builds a running gateway from its config."""

from __future__ import annotations

import logging

import grpc

from gateway.clients import DrafterClient, VerifierClient
from gateway.config import GatewayConfig
from gateway.generation import Generator
from gateway.service import GatewayServicer
from pardec.serving import start_server

log = logging.getLogger(__name__)


def build_generator(config: GatewayConfig, verifier_wait_s: float = 600.0) -> Generator:
    verifier = VerifierClient(config.verifier_target, config.rpc_timeout_s)
    drafter = DrafterClient(config.drafter_target, config.rpc_timeout_s)
    model = verifier.model_info(wait_s=verifier_wait_s)
    log.info("serving %s (%s), maxSeqLen %d", model.model_name, model.quantization, model.max_seq_len)
    return Generator(config, verifier, drafter, model)


def serve(config: GatewayConfig, address: str) -> tuple[grpc.Server, str]:
    return start_server([GatewayServicer(build_generator(config)).add_to], address)
