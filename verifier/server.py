"""Builds a verifier from its config: loads the model and wraps it in the gRPC servicer."""

from __future__ import annotations

import logging
import time

import torch

from verifier.config import VerifierConfig
from verifier.engine import Engine
from verifier.model import Transformer
from verifier.service import VerifierServicer
from verifier.weights import load_checkpoint

log = logging.getLogger(__name__)


def build_engine(config: VerifierConfig) -> Engine:
    if config.threads:
        torch.set_num_threads(config.threads)
    start = time.perf_counter()
    checkpoint = load_checkpoint(config.model_path)
    model = Transformer.from_checkpoint(checkpoint, quantization=config.quantization, device=config.device)
    log.info(
        "loaded %s (%s, %s) on %s in %.1fs",
        checkpoint.model_name, checkpoint.args.architecture, config.quantization, config.device,
        time.perf_counter() - start,
    )
    return Engine(model, checkpoint.tokenizer, checkpoint.model_name, config)


def build_servicer(config: VerifierConfig) -> VerifierServicer:
    return VerifierServicer(build_engine(config))
