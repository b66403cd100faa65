"""The native W8A8 linear kernel (verifier/int8_linear.c): the torch path's bits for every shape,
input dtype and row count, whatever else is in the call."""

import pytest
import torch

from verifier import native_linear
from verifier.quant import W8A8Linear


@pytest.fixture(scope="module")
def kernel():
    if native_linear.load() is None:
        pytest.skip("no C compiler: the verifier uses torch's int8 kernels")


def test_pack_lays_out_the_dot_product_operands():
    weight = torch.arange(-80, 80, dtype=torch.int8).reshape(16, 10)
    packed, correction, k_padded = native_linear.pack(weight)
    assert packed.shape == (1, 3, 4, 16, 4) and k_padded == 12  # 64 channels: one whole tile
    assert packed[0, 0, 0, 0].tolist() == [-80, -79, -78, -77]  # channel 0, inputs 0..3
    assert packed[0, 0, 0, 1].tolist() == [-70, -69, -68, -67]  # channel 1, inputs 0..3
    assert packed[0, 2, 0, 15].tolist() == [78, 79, 0, 0]  # channel 15, inputs 8, 9 and the padding
    assert not packed[0, :, 1:].any()  # channels 16..63: padding
    assert correction.tolist() == (weight.long().sum(1) * 128).tolist()
    assert torch.equal(native_linear.unpack(packed, 16, 10), weight)
    odd = torch.randint(-127, 128, (21, 7), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    odd_packed, _, _ = native_linear.pack(odd)
    assert odd_packed.shape == (1, 2, 4, 16, 4) and torch.equal(native_linear.unpack(odd_packed, 21, 7), odd)


@pytest.mark.parametrize("out_features, in_features", [(96, 1536), (21, 7), (1536, 576), (40, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_gives_the_torch_paths_bits(kernel, out_features, in_features, dtype):
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    reference = W8A8Linear(weight, bias=bias, kernel="fp32_exact")
    native = W8A8Linear(weight, bias=bias, kernel="native")
    assert torch.equal(native.integer_weight(), reference.integer_weight())
    x = torch.randn(37, in_features, generator=generator, dtype=dtype) * 4
    x[5] = 0  # an all-zero row: scale floored, output is the bias
    x[6, 0] = 1e30  # one huge value: every other value of the row quantizes to 0
    full = native(x)
    assert full.dtype == torch.float32 and torch.equal(full, reference(x))
    assert torch.equal(full[5], bias)
    # Every row count 1..16 covers each row-tile remainder; a row's bits never depend on its batch.
    for rows in range(1, 17):
        assert torch.equal(native(x[rows : 2 * rows]), full[rows : 2 * rows]), rows


@pytest.mark.parametrize("out_features, in_features, block", [(96, 1536, 64), (576, 64, 64), (40, 24, 8)])
def test_the_fused_input_hadamard_gives_the_torch_paths_bits(kernel, out_features, in_features, block):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator)
    reference = W8A8Linear(weight, kernel="fp32_exact", input_hadamard=block)
    native = W8A8Linear(weight, kernel="native", input_hadamard=block)
    x = torch.randn(21, in_features, generator=generator) * 3
    full = native(x)
    assert torch.equal(full, reference(x))
    assert not torch.equal(full, W8A8Linear(weight, kernel="native")(x))  # the transform did run
    assert all(torch.equal(native(x[i : i + 1])[0], full[i]) for i in range(21))
    with pytest.raises(ValueError, match="input_hadamard"):
        W8A8Linear(weight, kernel="native", input_hadamard=48)


def test_native_probe_passes_here(kernel):
    from verifier.quant import native_is_exact

    assert native_is_exact()
