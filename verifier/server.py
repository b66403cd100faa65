"""Builds a verifier from its config: loads the model and wraps it in the gRPC servicer."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pardec.runtime.errors import ConfigError
from pardec.runtime.tracing import Tracer
from pardec.verifier.loading import load_model
from pardec.verifier.prepare.cache import PreparedCache, checkpoint_fingerprint, default_directory
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.costcurve import POSITIONS as COST_CURVE_POSITIONS, measure_cost_curve, remembered_cost_curve
from pardec.verifier.engine.devices import Workers, resolve_device
from pardec.verifier.engine.engine import Engine
from pardec.verifier.engine.interface import ServingEngine
from pardec.verifier.generation_config import generation_defaults
from pardec.verifier.service import VerifierServicer
from pardec.verifier.model.weights import load_checkpoint

log = logging.getLogger(__name__)


def build_engine(config: VerifierConfig) -> ServingEngine:
    """One Engine, or Workers over one Engine per device when config.devices lists several."""
    if config.threads:
        torch.set_num_threads(config.threads)
    devices = [resolve_device(spec) for spec in config.worker_devices]  # fails before the slow load
    start = time.perf_counter()
    checkpoint = load_checkpoint(config.model_path)
    # Served in place of the checkpoint's own; the weights' preparation keeps the checkpoint's
    # (its calibration prompts, and the prepared-weight cache's key, do not change with it).
    tokenizer = checkpoint.tokenizer
    kept = generatable(tokenizer.stop_token_ids, checkpoint.args.vocab_size, config.model_path)
    if kept != tokenizer.stop_token_ids:
        tokenizer = dataclasses.replace(tokenizer, stop_token_ids=kept)
    if config.chat_template:
        tokenizer = dataclasses.replace(tokenizer, chat_template=config.chat_template)
    name = config.served_model_name or checkpoint.model_name
    context = checkpoint.args.max_position
    if config.max_seq_len > context:  # served as the context, so that the gateway refuses what would not fit
        log.warning("max_seq_len %d exceeds the model's context of %d positions: serving %d",
                    config.max_seq_len, context, context)
        config = dataclasses.replace(config, max_seq_len=context, max_input_tokens=min(config.max_input_tokens,
                                                                                       context - 1))
    cache_dir = default_directory() if config.prepared_cache_dir is None else config.prepared_cache_dir
    prepared_cache = PreparedCache(cache_dir) if cache_dir else None
    engines = []
    for device in devices:
        model = load_model(
            checkpoint, quantization=config.quantization, device=device, attention=config.attention,
            prepared_cache=prepared_cache,
            kv_dtype=None if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype),
            embedding_dtype=None if config.embedding_dtype == "auto" else getattr(torch, config.embedding_dtype),
            positions=max(config.max_seq_len, COST_CURVE_POSITIONS),
        )
        log.info(
            "loaded %s (%s, %s, kernel %s, attention %s, kv cache %s, embedding %s) on %s in %.1fs",
            name, checkpoint.args.architecture, config.quantization, model.kernel,
            model.attention, str(model.kv_dtype).removeprefix("torch."),
            str(model.tok_embeddings.dtype).removeprefix("torch."), device,
            time.perf_counter() - start,
        )
        engine = Engine(model, tokenizer, name, config, device=str(device))
        if config.measure_cost_curve:
            # On the engine thread: it is the thread (and thread pool) that will run the steps.
            begin = time.perf_counter()

            def measure(e=engine):
                return e.call(lambda: measure_cost_curve(e.model, e.pool))

            if cache_dir and checkpoint.source:
                card = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
                identity = {"checkpoint": checkpoint_fingerprint(checkpoint.source), "device": f"{device} {card}",
                            "quantization": config.quantization, "kernel": model.kernel, "attention": model.attention,
                            "threads": torch.get_num_threads(), "block_tokens": config.kv_block_tokens,
                            "pool_tokens": config.kv_pool_tokens, "kv_dtype": str(model.kv_dtype),
                            "embedding_dtype": str(model.tok_embeddings.dtype),
                            "adapt_threads": config.adapt_threads}
                engine.cost_curve = remembered_cost_curve(cache_dir, identity, measure)
            else:
                engine.cost_curve = measure()
            log.info("cost curve on %s in %.1fs: %s", device, time.perf_counter() - begin,
                     ", ".join(f"{t}x{b}: {ms:.1f} ms" for t, b, ms in engine.cost_curve))
        engines.append(engine)
    return engines[0] if len(engines) == 1 else Workers(engines)


def generatable(stop_token_ids: tuple[int, ...], vocab_size: int, model_path: str | None) -> tuple[int, ...]:
    """The end-of-sequence ids the model can generate. Others (a base model's, named in a
    fine-tune's generation_config.json that has fewer tokens) are left out, said in the log:
    every request would be refused for them; none left stops the start.

    >>> generatable((2, 151645), 49152, "m")
    (2,)
    >>> generatable((151645,), 49152, "m")
    Traceback (most recent call last):
    ...
    pardec.runtime.errors.ConfigError: m: every end-of-sequence id [151645] is outside the model's vocabulary of 49152
    """
    kept = tuple(token for token in stop_token_ids if token < vocab_size)
    if not kept:
        raise ConfigError(f"{model_path}: every end-of-sequence id {list(stop_token_ids)} is outside the model's "
                          f"vocabulary of {vocab_size}")
    if kept != stop_token_ids:
        log.warning("end-of-sequence ids outside the model's vocabulary of %d left out: %s", vocab_size,
                    sorted(set(stop_token_ids) - set(kept)))
    return kept


def build_servicer(config: VerifierConfig) -> VerifierServicer:
    defaults = generation_defaults(config.generation_config, config.model_path)  # checked before the slow load
    if defaults:
        log.info("HTTP requests' default sampling, from %s: %s", "the model's generation config"
                 if config.generation_config == "auto" else config.generation_config,
                 ", ".join(f"{name} {value:g}" for name, value in defaults))
    tracer = Tracer("pardec-verifier", config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
    return VerifierServicer(build_engine(config), defaults, tracer)
