"""The device engine's Triton int8 GEMM (verifier/kernels/triton_int8_gemm.py): torch._int_mm's bits
for every tiling, split of K, ragged edge and row count, and a device forward through it that gives
the same logits as through torch._int_mm. On CPU under Triton's interpreter; `--device cuda` on a
GPU, where the chooser's timing runs too."""

import pytest
import torch

triton = pytest.importorskip("triton")

from pardec.verifier.kernels import triton_int8_gemm  # noqa: E402
from pardec.verifier.kernels.triton_int8_gemm import GemmConfig, Int8Gemm, matmul, parse_gemm  # noqa: E402


def operands(M, K, N, on, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8).t()  # column-major, as the engine holds it
    return a.to(on), w.to(on)


def reference(a, w):
    return (a.cpu().long() @ w.cpu().long()).int()  # exact: int64 sums


@pytest.mark.parametrize("M,K,N,config", [
    (24, 256, 96, GemmConfig(32, 32, 64)),  # rows and columns short of a block
    (40, 192, 64, GemmConfig(32, 64, 64, split_k=2)),  # two row blocks; K split, partial sums added
    (8, 200, 48, GemmConfig(16, 16, 64, split_k=3)),  # K not a multiple of the split's steps
    (33, 96, 80, GemmConfig(64, 32, 32, split_k=4)),  # a split past K's end adds zeros
])
def test_every_tiling_gives_the_exact_int32_product(M, K, N, config, on):
    a, w = operands(M, K, N, on)
    out = torch.full((M, N), 7, dtype=torch.int32, device=on)  # split K must not add to what was there
    matmul(a, w, out, config)
    assert torch.equal(out.cpu(), reference(a, w))


def test_extreme_values_sum_exactly(on):
    K = 4096
    a = torch.full((16, K), -127, dtype=torch.int8, device=on)
    w = torch.full((32, K), -127, dtype=torch.int8, device=on).t()
    out = torch.empty(16, 32, dtype=torch.int32, device=on)
    matmul(a, w, out, GemmConfig(16, 32, 256, split_k=2))
    assert int(out[0, 0]) == 127 * 127 * K and torch.equal(out.cpu(), reference(a, w))


def test_operand_layouts_and_sizes_are_checked(on):
    a, w = operands(16, 64, 32, on)
    with pytest.raises(ValueError, match="column-major"):
        matmul(a, w.t().contiguous().t().contiguous(), torch.empty(16, 32, dtype=torch.int32, device=on),
               GemmConfig(16, 32, 64))
    with pytest.raises(ValueError, match="power of two"):
        GemmConfig(24, 32, 64)
    with pytest.raises(ValueError, match="block_k must be >= 32"):
        GemmConfig(16, 32, 16)


def test_the_choice_parses():
    assert parse_gemm("auto") == "auto" and parse_gemm("cublas") == "cublas"
    assert parse_gemm("m32n64k256s2w4p3") == GemmConfig(32, 64, 256, 2, 4, 3)
    with pytest.raises(ValueError, match="expected 'auto', 'cublas' or a tiling"):
        parse_gemm("fast")


def test_the_chooser_keeps_the_librarys_bits(on):
    """auto times the candidates on a GPU (the interpreter: torch._int_mm); whatever it picks, the
    product is torch._int_mm's; a fixed tiling is used as given."""
    a, w = operands(32, 512, 256, on, seed=1)
    for choice in ("auto", "cublas", GemmConfig(32, 64, 128, split_k=2)):
        gemm = Int8Gemm(choice, repeats=3)
        out = torch.empty(32, 256, dtype=torch.int32, device=on)
        gemm(a, w, out)
        assert torch.equal(out.cpu(), reference(a, w))
        assert (32, 512, 256) in gemm.chosen
        if isinstance(choice, GemmConfig):
            assert gemm.chosen[32, 512, 256] == choice
        if on.type == "cuda" and choice == "auto":
            assert "cublas" in gemm.timings[32, 512, 256] and len(gemm.timings[32, 512, 256]) > 1


def test_a_device_forward_through_the_triton_gemm_gives_the_librarys_logits(on, monkeypatch):
    from pardec.verifier.model.args import ModelArgs
    from pardec.verifier.model.kvcache import KVPool
    from pardec.verifier.model.transformer import Transformer
    from tests.steps import chain_step
    from tests.test_quant import tiny_tensors

    ARGS = ModelArgs(architecture="llama", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                     rope_theta=1e4, norm_eps=1e-6, max_position=256, tie_embeddings=True, qkv_bias=False)
    tensors = tiny_tensors(ARGS)
    prompt = torch.randint(0, ARGS.vocab_size, (13,), generator=torch.Generator().manual_seed(4))
    logits = {}
    for choice in ("cublas", "m32n32k64s2w4p3"):
        monkeypatch.setattr(triton_int8_gemm, "GEMM", choice)
        model = Transformer(ARGS, tensors, "w8a8", kernel="int_mm", attention="triton").to(on)
        cache = KVPool(ARGS, 256, 16, device=on, dtype=torch.float32).session()
        cache.reserve(len(prompt))
        logits[choice] = model.forward_batch([chain_step(prompt, cache)])[0].cpu()
        assert set(model.device_forward.gemm.chosen.values()) == ({None} if choice == "cublas"
                                                                  else {parse_gemm(choice)})
    assert torch.equal(logits["cublas"], logits["m32n32k64s2w4p3"])
