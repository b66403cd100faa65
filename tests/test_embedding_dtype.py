"""What the embedding table is kept in (`--embedding-dtype`, transformer.embedding_table): an int8
checkpoint's bf16 table stays bf16 (half fp32's bytes, the same numbers, so the same logits);
`bfloat16` over a prepared model's rotated table rounds it once, and parallel decoding through the
real gRPC stack is still plain decoding token for token; replicas whose tables were kept otherwise
are refused, naming the field."""

from __future__ import annotations

import pytest
import torch

from pardec.runtime.errors import ConfigError
from pardec.runtime.serving import start_server
from pardec.v1 import gateway_pb2, verifier_pb2
from pardec.verifier.__main__ import config_from_args, parse_args
from pardec.verifier.config import VerifierConfig
from pardec.verifier.loading import load_model
from pardec.verifier.model.transformer import embedding_table
from pardec.verifier.model.weights import load_checkpoint
from pardec.verifier.service import VerifierServicer
from tests.engine_stack import assert_parallel_is_plain, engine_stack
from tests.test_quant import COMPRESSED_TENSORS_W8A8, TOKENS, compress, logits, tiny_args, tiny_tensors, write_hf_dir


def test_the_setting_is_checked_and_read_from_the_command_line():
    with pytest.raises(ConfigError, match=r"embedding_dtype: 'int8' is not one of \('auto', 'bfloat16', 'float32'\)"):
        VerifierConfig(embedding_dtype="int8")
    assert config_from_args(parse_args(["--embedding-dtype", "bfloat16"])).embedding_dtype == "bfloat16"
    assert config_from_args(parse_args([])).embedding_dtype == "auto"


def test_a_table_is_kept_in_the_narrowest_dtype_that_holds_it_exactly():
    halves = torch.tensor([[0.5, -2.0, 3.0], [1.0, 0.0, -0.25]])
    table, rounded = embedding_table(halves)
    assert (table.dtype, rounded) == (torch.bfloat16, False) and torch.equal(table.float(), halves)
    fine = halves + torch.tensor([[2.0 ** -9, 0.0, 0.0], [0.0, 0.0, 0.0]])  # within fp16's 10 mantissa bits only
    table, rounded = embedding_table(fine)
    assert (table.dtype, rounded) == (torch.float16, False) and torch.equal(table.float(), fine)
    large = torch.full((2, 3), 1e5)  # past fp16's range, and 1e5 needs more bits than bf16's 8
    assert embedding_table(large)[0].dtype == torch.float32
    # Rows are compared a slice at a time: one entry past the first slice decides it too.
    big = torch.ones(5000, 4)
    big[4500, 2] = 0.1
    table, rounded = embedding_table(big)
    assert (table.dtype, rounded) == (torch.float32, False) and torch.equal(table, big)

    table, rounded = embedding_table(big, torch.bfloat16)  # asked for: rounded to nearest even
    assert (table.dtype, rounded) == (torch.bfloat16, True) and table[4500, 2].item() == 0.10009765625
    table, rounded = embedding_table(halves, torch.bfloat16)
    assert (table.dtype, rounded) == (torch.bfloat16, False)
    table, rounded = embedding_table(halves, torch.float32)
    assert (table.dtype, rounded) == (torch.float32, False)
    with pytest.raises(ValueError, match="embedding_dtype"):
        embedding_table(halves, torch.int8)


def test_an_int8_checkpoint_keeps_its_bf16_table_as_stored(tmp_path):
    """compressed-tensors' tables are bf16 as published: kept so, the logits are fp32's bit for bit."""
    args = tiny_args("qwen2")
    tensors = tiny_tensors(args)
    tensors["tok_embeddings.weight"] = tensors["tok_embeddings.weight"].bfloat16()
    write_hf_dir(tmp_path, args, compress(tensors), load_checkpoint(None).tokenizer, COMPRESSED_TENSORS_W8A8)
    checkpoint = load_checkpoint(str(tmp_path))
    kept, widened = (load_model(checkpoint, "w8a8", embedding_dtype=dtype) for dtype in (None, torch.float32))
    assert (kept.tok_embeddings.dtype, kept.embedding_rounded) == (torch.bfloat16, False)
    assert (widened.tok_embeddings.dtype, widened.embedding_rounded) == (torch.float32, False)
    assert kept.tok_embeddings.nbytes * 2 == widened.tok_embeddings.nbytes
    assert torch.equal(kept.tok_embeddings.float(), widened.tok_embeddings)
    assert torch.equal(logits(kept, TOKENS), logits(widened, TOKENS))


def test_a_tied_head_is_quantized_from_the_table_before_it_is_rounded(tmp_path):
    """An int8 checkpoint with an fp32 table asked to keep it in bf16: the table is rounded, the
    tied head is the one the exact table makes."""
    args = tiny_args("llama")
    write_hf_dir(tmp_path, args, compress(tiny_tensors(args)), load_checkpoint(None).tokenizer, COMPRESSED_TENSORS_W8A8)
    checkpoint = load_checkpoint(str(tmp_path))
    table = checkpoint.tensors["tok_embeddings.weight"]
    rounded, exact = (load_model(checkpoint, "w8a8", kernel="fp32_exact", embedding_dtype=dtype)
                      for dtype in (torch.bfloat16, None))
    assert (rounded.embedding_rounded, exact.tok_embeddings.dtype) == (True, torch.float32)
    assert torch.equal(rounded.tok_embeddings, table.to(torch.bfloat16))
    assert torch.equal(rounded.output.integer_weight(), exact.output.integer_weight())
    assert torch.equal(rounded.output.weight_scale, exact.output.weight_scale)


@pytest.fixture(scope="module")
def rounded_stack(redis_server, device):
    config = VerifierConfig(measure_cost_curve=False, embedding_dtype="bfloat16", kv_pool_tokens=8192, device=device)
    with engine_stack(config, redis_server.url) as stack:
        yield stack


def test_a_prepared_table_in_bf16_is_rounded_once_and_said_so(rounded_stack, engine):
    rounded, verifier, gateway = rounded_stack
    assert (engine.model.tok_embeddings.dtype, engine.model.embedding_rounded) == (torch.float32, False)
    table = rounded.model.tok_embeddings
    assert (table.dtype, rounded.model.embedding_rounded) == (torch.bfloat16, True)
    assert torch.equal(table, engine.model.tok_embeddings.detach().to(torch.bfloat16))  # the same table, rounded
    info = verifier.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=60)
    assert (info.embedding_dtype, info.embedding_rounded) == ("bfloat16", True)
    served = gateway.GetServedModel(gateway_pb2.GetServedModelRequest(), timeout=60)
    assert (served.embedding_dtype, served.embedding_rounded) == ("bfloat16", True)


def test_parallel_decoding_over_a_rounded_table_is_plain_decoding(rounded_stack):
    _, _, gateway = rounded_stack
    assert_parallel_is_plain(gateway)


def test_a_gateway_refuses_replicas_whose_tables_differ(rounded_stack, engine):
    """A session moved between replicas must get the same logits: a replica with a rounded table
    beside one with the exact table is refused at the gateway's start, naming the field."""
    from pardec.gateway.replicas import VerifierReplicas

    rounded, _, _ = rounded_stack
    servers = [start_server([VerifierServicer(e).add_to], "127.0.0.1:0") for e in (engine, rounded)]
    try:
        replicas = VerifierReplicas.connect(",".join(address for _, address in servers), 30.0)
        with pytest.raises(ConfigError, match="replica 1 runs embedding_rounding 'bfloat16', replica 0 'none'"):
            replicas.model_info(30.0)
    finally:
        for server, _ in servers:
            server.stop(None)
