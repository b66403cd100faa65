"""W8A8 preparation: rotation and smoothing keep the float function, int8 compressed-tensors
checkpoints load as stored, and the NPU kernel (only where torch-npu is installed)."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from pardec.bench.big_checkpoint import COMPRESSED_TENSORS_W8A8  # llm-compressor's W8A8 int8 scheme
from pardec.verifier.loading import load_model
from pardec.verifier.prepare.gptq import DAMPING, gptq_quantize
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.args import ModelArgs
from pardec.verifier.model.transformer import Transformer
from pardec.verifier.model.quant import W8A8Linear, kernel_is_exact, native_is_exact, quantize_activation, quantize_weight
from pardec.verifier.prepare.rotation import DOWN_HADAMARD_BLOCK, _hadamard, orthogonal_matrix, rotate
from pardec.verifier.model.quant import block_hadamard
from pardec.verifier.prepare.smoothing import SmoothingAlphas, smooth, smoothing_factors
from pardec.verifier.model.weights import load_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

VOCAB = 49152  # the bundled tokenizer's, so its chat template and text encode into this vocabulary


@pytest.fixture(scope="module")
def tokenizer():
    return load_checkpoint(None).tokenizer


def tiny_args(architecture="qwen2", ffn_dim=80) -> ModelArgs:
    """ffn_dim 80 has no online Hadamard block (rotation.DOWN_HADAMARD_BLOCK divides 128)."""
    return ModelArgs(architecture=architecture, vocab_size=VOCAB, dim=48, n_layers=2, n_heads=4, n_kv_heads=2,
                     ffn_dim=ffn_dim, rope_theta=1e4, norm_eps=1e-5, max_position=64, tie_embeddings=True,
                     qkv_bias=architecture == "qwen2")


def tiny_tensors(args: ModelArgs, seed=0) -> dict[str, torch.Tensor]:
    """Random weights in gpt-fast names, with outlier channels and non-unit norms, as real models have."""
    generator = torch.Generator().manual_seed(seed)
    kv = args.n_kv_heads * args.head_dim

    def normal(*shape, std=0.2):
        return torch.randn(*shape, generator=generator) * std

    tensors = {"tok_embeddings.weight": normal(args.vocab_size, args.dim),
               "norm.weight": 1 + normal(args.dim, std=0.3)}
    tensors["tok_embeddings.weight"][:, 5] *= 20  # an outlier residual channel
    for layer in range(args.n_layers):
        p = f"layers.{layer}"
        tensors |= {
            f"{p}.attention_norm.weight": 1 + normal(args.dim, std=0.3), f"{p}.ffn_norm.weight": 1 + normal(args.dim, std=0.3),
            f"{p}.attention.wq.weight": normal(args.dim, args.dim), f"{p}.attention.wk.weight": normal(kv, args.dim),
            f"{p}.attention.wv.weight": normal(kv, args.dim), f"{p}.attention.wo.weight": normal(args.dim, args.dim),
            f"{p}.feed_forward.w1.weight": normal(args.ffn_dim, args.dim),
            f"{p}.feed_forward.w3.weight": normal(args.ffn_dim, args.dim),
            f"{p}.feed_forward.w2.weight": normal(args.dim, args.ffn_dim),
        }
        if args.qkv_bias:
            tensors |= {f"{p}.attention.wq.bias": normal(args.dim), f"{p}.attention.wk.bias": normal(kv),
                        f"{p}.attention.wv.bias": normal(kv)}
    return tensors


def logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    count = len(tokens)
    cache = KVCache(model.args, count)
    cache.reserve(count)
    return model(torch.tensor(tokens), torch.arange(count), torch.ones(count, count, dtype=torch.bool).tril(), cache)


TOKENS = [1, 400, 2000, 31000, 77, 5, 49000, 12, 600, 3]


@pytest.mark.parametrize("size", [576, 64, 896, 7])
def test_orthogonal_matrix_is_orthogonal_and_fixed(size):
    matrix = orthogonal_matrix(size, seed=0)
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(size), rtol=0, atol=1e-5)
    assert torch.equal(matrix, orthogonal_matrix(size, seed=0))
    assert not torch.equal(matrix, orthogonal_matrix(size, seed=1))


def test_block_hadamard_is_the_block_diagonal_product_and_row_invariant():
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-50, 50, (5, 192), generator=generator).float()  # integers: every sum exact
    matrix = torch.block_diag(*[_hadamard(64) * 8] * 3).float()  # Sylvester's, unnormalized
    assert torch.equal(block_hadamard(x, 64), x @ matrix)
    assert torch.equal(block_hadamard(block_hadamard(x, 64), 64), x * 64)  # H H = 64 I
    rows = torch.randn(9, 1536, generator=generator)
    whole = block_hadamard(rows, DOWN_HADAMARD_BLOCK)
    assert all(torch.equal(block_hadamard(rows[i : i + 1], DOWN_HADAMARD_BLOCK)[0], whole[i]) for i in range(9))
    with pytest.raises(ValueError, match="power of two"):
        block_hadamard(rows, 48)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("ffn_dim", [80, 128])
def test_rotation_and_smoothing_keep_the_float_function(architecture, ffn_dim):
    args = tiny_args(architecture, ffn_dim)
    tensors = tiny_tensors(args)
    expected = logits(Transformer(args, tensors, "none"), TOKENS)
    rotated = rotate(args, tensors)
    assert rotated["norm.weight"].eq(1).all() and "output.weight" in rotated
    # down_proj's input is rotated online where a block divides ffn_dim: the float model applies
    # it, the weights hold the inverse.
    block = DOWN_HADAMARD_BLOCK if ffn_dim % DOWN_HADAMARD_BLOCK == 0 else 0
    assert int(rotated.get("layers.1.feed_forward.w2.input_hadamard", 0)) == block
    assert Transformer(args, rotated, "none").layers[1].feed_forward.w2.input_hadamard == block
    torch.testing.assert_close(logits(Transformer(args, rotated, "none"), TOKENS), expected, rtol=0, atol=1e-4)
    # Any positive maxima give an equivalent model; these vary by orders of magnitude per channel.
    generator = torch.Generator().manual_seed(1)
    model = Transformer(args, rotated, "none")
    maxima = {name: torch.rand(module.weight.shape[1], generator=generator).mul(8).exp()
              for name, module in model.named_modules() if getattr(module, "weight", None) is not None
              and module.weight.dim() == 2}
    smoothed = smooth(args, rotated, smoothing_factors(args, rotated, maxima, SmoothingAlphas(0.5, 0.5, 0.5, 0.5, 0.5)))
    torch.testing.assert_close(logits(Transformer(args, smoothed, "none"), TOKENS), expected, rtol=0, atol=1e-3)
    assert torch.equal(rotated["norm.weight"], torch.ones(args.dim))  # the input dict is left alone


def textbook_gptq(weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """GPTQ as first described, in fp64: quantize column j, spread its error over the later columns
    with the inverse Hessian, then remove j from the inverse (the OBS update)."""
    weight = weight.double().clone()
    scale = weight.abs().amax(dim=1) / 127
    hessian = hessian.double().clone()
    hessian.diagonal().add_(DAMPING * hessian.diagonal().mean())
    inverse = torch.linalg.inv(hessian)
    values = torch.empty_like(weight)
    for j in range(weight.shape[1]):
        values[:, j] = torch.round(weight[:, j] / scale).clamp(-127, 127)
        error = (weight[:, j] - values[:, j] * scale) / inverse[j, j]
        weight[:, j + 1 :] -= error[:, None] * inverse[j, j + 1 :][None]
        inverse = inverse - inverse[:, j : j + 1] @ inverse[j : j + 1, :] / inverse[j, j]
    return values


def test_gptq_matches_the_textbook_algorithm_and_beats_rounding():
    generator = torch.Generator().manual_seed(3)
    # Correlated inputs with an outlier channel; more columns than one block of GPTQ.
    inputs = torch.randn(300, 40, generator=generator) @ torch.randn(40, 40, generator=generator)
    inputs[:, 7] *= 10
    hessian = inputs.double().T @ inputs.double()
    weight = torch.randn(2, 24, 40, generator=generator)
    values, scale = gptq_quantize(weight, hessian.expand(2, 40, 40))
    assert values.dtype == torch.int8 and torch.equal(scale, weight.abs().amax(dim=-1) / 127)
    single, _ = gptq_quantize(weight[1], hessian)
    assert torch.equal(single, values[1])  # a batch of layers is quantized as each alone

    def output_error(int_values, scales, layer):
        difference = weight[layer].double() - int_values.double() * scales[layer].double()[:, None]
        return torch.einsum("oi,ij,oj->", difference, hessian, difference).item()

    for layer in range(2):
        reference = textbook_gptq(weight[layer], hessian)
        # fp32 against fp64 arithmetic: a value just at a rounding boundary may go the other way.
        assert (values[layer].double() != reference).double().mean() < 0.01
        assert output_error(values[layer], scale, layer) < 1.01 * output_error(reference, scale, layer)
        rounded, _ = quantize_weight(weight[layer])
        assert output_error(values[layer], scale, layer) < 0.5 * output_error(rounded, scale, layer)


def test_smoothing_alphas_are_validated():
    with pytest.raises(ValueError, match="down"):
        SmoothingAlphas(down=1.5)


def write_hf_dir(path, args: ModelArgs, tensors: dict[str, torch.Tensor], tokenizer, quantization_config=None):
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    layer_names = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                   "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                   "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                   "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}
    hf = {}
    for name, tensor in tensors.items():
        if name in names:
            hf[names[name]] = tensor
            continue
        _, layer, rest = name.split(".", 2)
        module, _, kind = rest.rpartition(".")
        hf[f"model.layers.{layer}.{layer_names[module]}.{kind}"] = tensor
    save_file({k: v.contiguous() for k, v in hf.items()}, str(path / "model.safetensors"))
    config = {"model_type": args.architecture, "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
              "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
              "num_key_value_heads": args.n_kv_heads, "max_position_embeddings": args.max_position,
              "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
              "tie_word_embeddings": args.tie_embeddings, "vocab_size": args.vocab_size}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}))


def compress(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The int-quantized layout: "<layer>.weight" int8 [out, in] and "<layer>.weight_scale" [out, 1]
    (bf16, as models are usually saved) for every linear layer; norms and embeddings stay float."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and tensor.dim() == 2 and not name.startswith(("tok_embeddings", "output")):
            scale = (tensor.abs().amax(dim=1, keepdim=True) / 127).bfloat16()
            out[name] = torch.round(tensor / scale.float()).clamp(-128, 127).to(torch.int8)
            out[name.removesuffix("weight") + "weight_scale"] = scale
            out[name.removesuffix("weight") + "weight_zero_point"] = torch.zeros(tensor.shape[0], 1, dtype=torch.int8)
        else:
            out[name] = tensor
    return out


def test_compressed_tensors_checkpoint_is_used_as_stored(tmp_path, tokenizer):
    args = tiny_args("qwen2")
    stored = compress(tiny_tensors(args))
    write_hf_dir(tmp_path, args, stored, tokenizer, COMPRESSED_TENSORS_W8A8)
    checkpoint = load_checkpoint(str(tmp_path))
    assert checkpoint.prequantized and checkpoint.args.qkv_bias

    model = load_model(checkpoint, "w8a8", kernel="fp32_exact")
    attention = model.layers[1].attention
    expected_qkv = torch.cat([stored[f"layers.1.attention.w{n}.weight"] for n in "qkv"])
    assert torch.equal(attention.wqkv.integer_weight(), expected_qkv.float())
    expected_scales = torch.cat([stored[f"layers.1.attention.w{n}.weight_scale"].float().flatten() for n in "qkv"])
    assert torch.equal(attention.wqkv.weight_scale, expected_scales)
    assert torch.equal(model.layers[0].feed_forward.w2.integer_weight(), stored["layers.0.feed_forward.w2.weight"].float())

    # One layer against the integer computation written out: stored int8 x per-token int8, in int64.
    x = torch.randn(9, args.dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x_values, x_scale = quantize_activation(x)
    weight, scale = stored["layers.0.attention.wo.weight"], stored["layers.0.attention.wo.weight_scale"]
    reference = (x_values.long() @ weight.long().T).float() * x_scale * scale.float().view(1, -1)
    assert torch.equal(model.layers[0].attention.wo(x), reference)

    # The whole model against a float model of the dequantized weights: W8A8 noise only.
    float_model = load_model(checkpoint, "none")
    torch.testing.assert_close(float_model.layers[0].attention.wo.weight, weight.float() * scale.float())
    quantized, dequantized = logits(model, TOKENS), logits(float_model, TOKENS)
    assert (quantized - dequantized).norm() < 0.05 * dequantized.norm()

    for kernel, usable in (("int_mm", kernel_is_exact("int_mm", "cpu")), ("native", native_is_exact())):
        if usable:
            int_model = load_model(checkpoint, "w8a8", kernel=kernel)
            assert torch.equal(logits(int_model, TOKENS), logits(model, TOKENS)), kernel


@pytest.mark.parametrize("change, message", [
    ({"format": "float-quantized"}, "format"),
    ({"config_groups": {"g": {**COMPRESSED_TENSORS_W8A8["config_groups"]["group_0"],
                              "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                    "strategy": "tensor", "dynamic": False}}}}, "strategy"),
    ({"config_groups": {"g": {**COMPRESSED_TENSORS_W8A8["config_groups"]["group_0"],
                              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}}},
     "num_bits"),
])
def test_other_quantization_configs_are_refused_by_name(tmp_path, tokenizer, change, message):
    args = tiny_args("llama")
    write_hf_dir(tmp_path, args, compress(tiny_tensors(args)), tokenizer, {**COMPRESSED_TENSORS_W8A8, **change})
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(tmp_path))


def test_static_activation_scales_are_refused(tmp_path, tokenizer):
    args = tiny_args("llama")
    tensors = compress(tiny_tensors(args))
    tensors["layers.0.attention.wq.input_scale"] = torch.ones(1)
    write_hf_dir(tmp_path, args, tensors, tokenizer, COMPRESSED_TENSORS_W8A8)
    with pytest.raises(ValueError, match="input_scale"):
        load_checkpoint(str(tmp_path))


def test_a_stored_scale_needs_int8_weights():
    with pytest.raises(ValueError, match="int8"):
        W8A8Linear(torch.randn(4, 8), weight_scale=torch.ones(4))


# Not in smoothing.py's calibration text: GPTQ fits the weights to the calibration inputs, so it
# is judged on other text.
HELD_OUT_TEXT = ("def mean(values):\n    return sum(values) / len(values)\n\n"
                 "Mountains rise where plates collide; their snow feeds the rivers below.")


def test_preconditioned_load_is_deterministic_and_closer_to_float(tmp_path, tokenizer):
    args = tiny_args("llama")
    write_hf_dir(tmp_path, args, tiny_tensors(args), tokenizer)
    checkpoint = load_checkpoint(str(tmp_path))
    first = load_model(checkpoint, "w8a8", kernel="fp32_exact")
    second = load_model(checkpoint, "w8a8", kernel="fp32_exact")
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    # The random model has an outlier residual channel: preconditioning must cut W8A8's error, and
    # GPTQ must cut it further.
    tokens = tokenizer.encode(HELD_OUT_TEXT)
    float_logits = logits(load_model(checkpoint, "none"), tokens)
    plain = load_model(checkpoint, "w8a8", kernel="fp32_exact", precondition=False)
    rounded = load_model(checkpoint, "w8a8", kernel="fp32_exact", gptq=False)
    error, rounded_error, plain_error = ((logits(m, tokens) - float_logits).norm() / float_logits.norm()
                                         for m in (first, rounded, plain))
    print(f"relative logit error: plain W8A8 {plain_error:.4f}, rotated + smoothed {rounded_error:.4f}, "
          f"+ GPTQ {error:.4f}")
    assert rounded_error < 0.8 * plain_error and error < 0.85 * rounded_error


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


@pytest.mark.skipif(not _npu_available(), reason="torch-npu and an Ascend NPU are not present on this host")
def test_npu_quant_matmul_is_exact_and_row_invariant():
    from pardec.verifier.model.ascend import startup_ops

    ops = startup_ops("npu:0")  # the product's exactness probe among its checks (a ConfigError otherwise)
    generator = torch.Generator().manual_seed(0)
    layer = W8A8Linear(torch.randn(96, 1536, generator=generator), kernel="npu_quant_matmul", ascend=ops).to("npu:0")
    x = (torch.randn(64, 1536, generator=generator) * 5).to("npu:0")
    full = layer(x)
    assert all(torch.equal(layer(x[i : i + 1])[0], full[i]) for i in range(64))
    # The CPU's function; not necessarily its bits (npu_dynamic_quant may round halves otherwise).
    cpu_layer = W8A8Linear(torch.randn(96, 1536, generator=torch.Generator().manual_seed(0)), kernel="fp32_exact")
    expected = cpu_layer(x.cpu())
    torch.testing.assert_close(full.cpu(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
