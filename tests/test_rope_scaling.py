"""Rotary scalings a checkpoint may state besides Llama 3.1's: YaRN (Qwen2.5's and Qwen3's long
context) and linear position interpolation, from config.json and from llama.cpp's GGUF metadata.
The frequencies are transformers' own, the float model's logits equal transformers' past the
original context, the W8A8 model's tree rows equal plain decoding, and what is not read is named."""

from __future__ import annotations

import math

import gguf
import pytest
import torch

from pardec.verifier.loading import load_model
from pardec.verifier.model.args import ModelArgs, RopeScaling
from pardec.verifier.model.checkpoint import rope_scaling, served_positions
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.rotary import inverse_frequencies, rotary_tables
from pardec.verifier.model.step import StepInput
from pardec.verifier.model.weights import default_model_path, load_checkpoint
from tests.steps import assert_nodes_are_plain_decoding, prefill
from tests.tiny_checkpoints import COMMON, FAMILIES, write_gguf, write_hf

# The tiny models' original context is 32 positions, so the 160 tested run 5x past it.
SCALINGS = {
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "linear": ("llama3.1", {"rope_type": "linear", "factor": 2.0}),
}
TEXT = "Positions past the original context still rotate as the reference rotates them. " * 8


def transformers_reference(family: str, scaling: dict, seed: int = 0):
    import transformers

    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama3.1": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    config = config_class(**COMMON, **{**FAMILIES[family], "rope_scaling": {"rope_theta": COMMON["rope_theta"], **scaling}})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=list(SCALINGS))
def scaled(request, checkpoint, tmp_path_factory):
    """(kind, reference model, HF directory, GGUF path)."""
    family, scaling = SCALINGS[request.param]
    model = transformers_reference(family, scaling)
    directory = write_hf(model, tmp_path_factory.mktemp(request.param), checkpoint.tokenizer)
    gguf_path = write_gguf(model, family, directory / "model.gguf", default_model_path())
    return request.param, model, directory, gguf_path


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "truncate": False,
     "attention_factor": 1.25},
    {"rope_type": "linear", "factor": 3.0},
])
def test_the_frequencies_and_the_attention_factor_are_transformers(scaling):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=8192,
                         rope_scaling={"rope_theta": 1e6, **scaling})
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    args = ModelArgs(architecture="qwen3", vocab_size=10, dim=512, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=8,
                     rope_theta=1e6, norm_eps=1e-6, max_position=64, tie_embeddings=True, qkv_bias=False,
                     head_dim=128, qk_norm=True, rope_scaling=rope_scaling(scaling, "config.json"))
    assert torch.equal(inverse_frequencies(args), expected)
    cos, signed_sin = rotary_tables(args)
    angles = torch.outer(torch.arange(64, dtype=torch.float32), expected)
    assert torch.equal(cos[:, : 64], angles.cos() * attention_factor)
    assert torch.equal(signed_sin[:, 64:], angles.sin() * attention_factor)


def test_yarn_serves_its_factor_times_the_original_context():
    yarn = RopeScaling("yarn", 4.0, 32768, attention_factor=1 + 0.1 * math.log(4))
    assert served_positions(40960, yarn) == 131072  # Qwen3's config with Qwen's stated rope_scaling
    assert served_positions(262144, yarn) == 262144
    # Position interpolation: the stated context, `factor` times (vLLM's reading), never less.
    assert served_positions(4096, RopeScaling("linear", 2.0)) == 8192
    assert served_positions(4096, RopeScaling("linear", 0.5)) == 4096


@pytest.mark.parametrize("layout", ["hf", "gguf"])
def test_float_logits_match_transformers_past_the_original_context(scaled, layout):
    kind, reference, directory, gguf_path = scaled
    loaded = load_checkpoint(str(directory if layout == "hf" else gguf_path))
    args = loaded.args
    assert args.rope_scaling is not None and args.rope_scaling.kind == kind
    tokens = loaded.tokenizer.encode(TEXT)[:160]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    model = load_model(loaded, "none")
    count = len(tokens)
    got = model(torch.tensor(tokens), torch.arange(count), torch.ones(count, count, dtype=torch.bool).tril(),
                KVCache(args, count))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    unscaled = load_model(type(loaded)(ModelArgs(**{**vars(args), "rope_scaling": None}), loaded.tensors,
                                       loaded.model_name, loaded.tokenizer), "none")
    other = unscaled(torch.tensor(tokens), torch.arange(count), torch.ones(count, count, dtype=torch.bool).tril(),
                     KVCache(args, count))
    assert (other - expected).abs().max() > 1e-3  # 10x the tolerance: the test sees the scaling


def test_a_scaled_w8a8_tree_row_is_plain_decoding(scaled):
    _, _, directory, _ = scaled
    model = load_model(load_checkpoint(str(directory)), "w8a8")
    pool = model.new_pool(1024, 8)
    prompt = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(4)).tolist()  # past 32 positions
    tokens, parents = torch.tensor([3, 40, 41, 77]), [-1, 0, 1, 0]
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    cache = prefill(model, pool, prompt)
    cache.reserve(4)
    logits = model.forward_batch([StepInput(tokens, torch.tensor([0, 1, 2, 1]), ancestors, cache)])[0]
    assert_nodes_are_plain_decoding(model, pool, prompt, tokens, parents, logits)


def test_a_model_served_for_fewer_positions_holds_their_tables_only(scaled):
    """load_model(positions=): the verifier's max_seq_len sizes the rotary tables (a YaRN model's
    full ones are 128 MiB at 131072) and its pools, which refuse a session past it; the tables are
    the full ones' first rows, so the logits are the same bits."""
    _, _, directory, _ = scaled
    checkpoint = load_checkpoint(str(directory))
    full, served = load_model(checkpoint, "w8a8"), load_model(checkpoint, "w8a8", positions=100)
    assert full.rope_cos.shape[0] == checkpoint.args.max_position > 100 == served.rope_cos.shape[0]
    assert torch.equal(served.rope_cos, full.rope_cos[:100])
    assert torch.equal(served.rope_signed_sin, full.rope_signed_sin[:100])
    prompt = torch.randint(0, 1000, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = []
    for model in (full, served):
        cache = model.new_pool(256, 8).session()
        cache.reserve(90)
        causal = torch.ones(90, 90, dtype=torch.bool).tril()
        logits.append(model.forward_batch([StepInput(torch.tensor(prompt), torch.arange(90), causal, cache)])[0])
    assert torch.equal(logits[0], logits[1])
    cache = served.new_pool(256, 8).session()
    with pytest.raises(ValueError, match="101 positions exceeds the 100 served"):
        cache.reserve(101)
    assert load_model(checkpoint, "w8a8", positions=10 ** 6).rope_cos.shape[0] == checkpoint.args.max_position


@pytest.mark.parametrize("scaling, named", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic'"),
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": -4.0, "original_max_position_embeddings": 32}, "factor must be positive"),
    ({"rope_type": "linear"}, "needs factor"),
])
def test_a_scaling_that_cannot_be_served_is_named(scaling, named):
    with pytest.raises(ValueError, match=named):
        rope_scaling(scaling, "config.json")


def test_llama_cpp_yarn_settings_it_does_not_read_are_named(scaled, tmp_path):
    kind, _, _, gguf_path = scaled
    if kind != "yarn":
        return
    reader = gguf.GGUFReader(str(gguf_path))
    architecture = str(reader.fields["general.architecture"].contents())
    assert load_checkpoint(str(gguf_path)).args.max_position == 512  # the config's, over 4 x 32
    writer = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), architecture)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_yarn_log_mul(0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="rope.scaling.yarn_log_multiplier is not supported"):
        load_checkpoint(str(tmp_path / "extra.gguf"))


def test_gguf_metadata_is_read_as_llama_cpp_reads_it():
    from pardec.verifier.model.weights import _gguf_rope_scaling

    def reading(fields: dict):
        return _gguf_rope_scaling({"qwen3.context_length": 40960, **fields}.get, "qwen3", "m.gguf")

    assert reading({}) is None and reading({"qwen3.rope.scaling.type": "none", "qwen3.rope.scaling.factor": 4.0}) is None
    # No type: linear, as llama.cpp defaults it; the factor also under its older key.
    assert reading({"qwen3.rope.scale_linear": 2.0}) == RopeScaling("linear", 2.0)
    assert reading({"qwen3.rope.scaling.factor": 2.0}) == RopeScaling("linear", 2.0)
    # YaRN without its original context: the file's context length, as llama.cpp takes it.
    yarn = reading({"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0})
    assert yarn.kind == "yarn" and yarn.original_max_position == 40960
    assert yarn.attention_factor == pytest.approx(1 + 0.1 * math.log(4))
    with pytest.raises(ValueError, match="m.gguf: rotary scaling 'longrope' is not supported"):
        reading({"qwen3.rope.scaling.type": "longrope", "qwen3.rope.scaling.factor": 4.0})


def test_a_scaling_number_that_is_not_one_is_named():
    with pytest.raises(ValueError, match=r"config.json: rope_scaling.beta_fast: 'x' must be a number"):
        rope_scaling({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": "x"},
                     "config.json")


def test_the_verifier_sizes_its_model_by_max_seq_len(engine):
    """build_engine passes max_seq_len (2560 by default; SmolLM2's context is 8192)."""
    from pardec.verifier.engine.costcurve import POSITIONS

    assert engine.model.rope_cos.shape[0] == max(engine.config.max_seq_len, POSITIONS) == 2560
    assert engine.pool.max_position == 2560 < load_checkpoint(None).args.max_position


def test_a_max_seq_len_past_the_models_context_serves_the_context(scaled):
    """A session past the model's positions cannot be computed: the verifier serves its context as
    max_seq_len (said in GetModelInfo, so the gateway refuses what would not fit, naming maxSeqLen)."""
    from pardec.v1 import verifier_pb2
    from pardec.verifier.config import VerifierConfig
    from pardec.verifier.server import build_engine
    from pardec.verifier.service import VerifierServicer

    _, _, directory, _ = scaled
    context = load_checkpoint(str(directory)).args.max_position
    engine = build_engine(VerifierConfig(model_path=str(directory), measure_cost_curve=False, prepared_cache_dir="",
                                         max_seq_len=context + 1000, max_input_tokens=context + 500, kv_pool_tokens=4096))
    try:
        assert (engine.config.max_seq_len, engine.config.max_input_tokens) == (context, context - 1)
        info = VerifierServicer(engine).GetModelInfo(verifier_pb2.GetModelInfoRequest(), None)
        assert info.max_seq_len == context
    finally:
        engine.close()
