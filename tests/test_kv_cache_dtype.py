"""A bf16 KV cache on CPU (`--kv-cache-dtype bfloat16`, vLLM's flag): half the pool's bytes per
token, and through the real gRPC stack parallel decoding still gives exactly plain decoding's
tokens (the kernels' bits: tests/test_native_attention.py, tests/test_native_layers.py)."""

from __future__ import annotations

import pytest
import torch

from pardec.runtime.errors import ConfigError
from pardec.runtime.serving import start_server
from pardec.verifier.__main__ import config_from_args, parse_args
from pardec.verifier.config import VerifierConfig
from pardec.verifier.service import VerifierServicer
from tests.engine_stack import assert_parallel_is_plain, engine_stack


def test_the_setting_is_checked_and_read_from_the_command_line():
    with pytest.raises(ConfigError, match=r"kv_cache_dtype: 'fp8' is not one of \('auto', 'bfloat16', 'float32'\)"):
        VerifierConfig(kv_cache_dtype="fp8")
    assert config_from_args(parse_args(["--kv-cache-dtype", "bfloat16"])).kv_cache_dtype == "bfloat16"
    assert config_from_args(parse_args([])).kv_cache_dtype == "auto"


@pytest.fixture(scope="module")
def bf16_stack(redis_server):
    config = VerifierConfig(measure_cost_curve=False, kv_cache_dtype="bfloat16", kv_pool_tokens=8192)
    with engine_stack(config, redis_server.url) as (engine, _, gateway):
        yield engine, gateway


def test_a_bf16_pool_holds_half_the_bytes_per_token(bf16_stack):
    engine, _ = bf16_stack
    assert engine.model.kv_dtype == torch.bfloat16 and engine.pool.kv.dtype == torch.bfloat16
    args = engine.model.args
    per_token = engine.pool.kv[:, :, :, :1].numel() * engine.pool.kv.element_size()
    assert per_token == args.n_layers * 2 * args.n_kv_heads * args.head_dim * 2  # 23 KB for the bundled model
    assert engine.model.fused_layers is not None and engine.model.native_attention.kv_dtype == torch.bfloat16


def test_parallel_decoding_over_a_bf16_cache_is_plain_decoding(bf16_stack):
    _, gateway = bf16_stack
    assert_parallel_is_plain(gateway)  # drafted tokens verified over the bf16 cache, not only plain steps


def test_the_device_engine_refuses_an_fp32_cache_before_any_preparation(checkpoint):
    from pardec.verifier.loading import load_model

    with pytest.raises(ConfigError, match="kv_cache_dtype: the device engine stores keys and values in bfloat16"):
        load_model(checkpoint, "w8a8", attention="triton", kv_dtype=torch.float32)


def test_a_gateway_refuses_replicas_whose_caches_differ(bf16_stack, engine):
    """A session moved between replicas must get the same logits: an fp32 replica and a bf16 one
    are refused at the gateway's start, naming the field."""
    from pardec.gateway.replicas import VerifierReplicas

    bf16_engine, _ = bf16_stack
    servers = [start_server([VerifierServicer(e).add_to], "127.0.0.1:0") for e in (engine, bf16_engine)]
    try:
        replicas = VerifierReplicas.connect(",".join(address for _, address in servers), 30.0)
        with pytest.raises(ConfigError, match="replica 1 runs kv_cache_dtype 'bfloat16', replica 0 'float32'"):
            replicas.model_info(30.0)
        alone = VerifierReplicas.connect(servers[1][1], 30.0).model_info(30.0)
        assert (alone.kv_cache_dtype, alone.attention) == ("bfloat16", "native")
    finally:
        for server, _ in servers:
            server.stop(None)


def test_a_replica_back_with_other_numerics_takes_no_session(bf16_stack, engine):
    """A replica unreachable at the gateway's start is compared before its first session: back
    with a bf16 cache beside an fp32 replica 0, it is refused (replica 0 down, no replica takes
    the session); back with replica 0's numerics, it takes it."""
    from pardec.gateway.replicas import VerifierReplicas
    from pardec.runtime.errors import Unavailable
    from pardec.verifier.api import Sampling

    bf16_engine, _ = bf16_stack
    first, first_address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")
    later, later_address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")
    later.stop(None)  # down while the gateway starts
    replicas = VerifierReplicas.connect(f"{first_address},{later_address}", 10.0, down_for_s=0.0)
    replicas.model_info(5.0)  # replica 1 not reachable: a warning, compared later
    first.stop(None)
    servers = []
    try:
        for back_with, takes in ((bf16_engine, False), (engine, True)):
            server, _ = start_server([VerifierServicer(back_with).add_to], later_address)
            servers.append(server)
            if takes:
                assert replicas.prefill("s-ok", [1, 2, 3], Sampling()).token >= 0
                replicas.release("s-ok")
            else:
                with pytest.raises(Unavailable, match="no replica could take session"):
                    replicas.prefill("s-refused", [1, 2, 3], Sampling())
                assert bf16_engine.sessions == 0  # refused before any Prefill reached it
            server.stop(None)
    finally:
        for server in servers:
            server.stop(None)
