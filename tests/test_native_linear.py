"""The native W8A8 linear kernel (verifier/int8_linear.c): the torch path's bits for every shape,
input dtype and row count, whatever else is in the call."""

import shutil

import pytest
import torch

from pardec.verifier.kernels import native_build, native_linear
from pardec.verifier.model.quant import W8A8Linear


@pytest.fixture(scope="module")
def kernel():
    if native_linear.load() is None:
        # A compiler that rejects the source must fail here, not pass as a skip.
        assert shutil.which("cc") is None, "cc is on PATH but int8_linear.c did not build (see the log)"
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


def test_the_avx2_layout_holds_each_block_of_16_channels_in_one_run():
    weight = torch.randint(-127, 128, (80, 10), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    packed, correction, _ = native_linear.pack(weight, blocks_contiguous=True)
    interleaved, same_correction, _ = native_linear.pack(weight)
    assert torch.equal(packed, interleaved) and torch.equal(correction, same_correction)  # same values
    assert native_linear.is_blocks_contiguous(packed) and not native_linear.is_blocks_contiguous(interleaved)
    memory = packed.permute(0, 2, 1, 3, 4).flatten()  # the bytes as they lie
    assert torch.equal(memory[:3 * 64], packed[0, :, 0].flatten())  # block 0's three groups, then ...
    assert torch.equal(memory[3 * 64:6 * 64], packed[0, :, 1].flatten())  # block 1's
    assert torch.equal(native_linear.unpack(packed, 80, 10), weight)


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


@pytest.mark.parametrize("out_features, in_features, block", [(96, 1536, 64), (576, 64, 64), (32, 48, 16), (40, 24, 8)])
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
    from pardec.verifier.model.quant import native_is_exact

    assert native_is_exact()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


# Each path int8_linear.c can compile to, with the flags that force it on a CPU that has more.
# The portable one is only used where neither instruction set exists, so no host would test it
# otherwise (its epilogue once wrote past its 16 channels, and the probe turned the kernel off).
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8")
VARIANTS = {
    "amx": ((), {"avx512f", "avx512_vnni", "amx_tile", "amx_int8"}),
    "avx512-vnni": (NO_AMX, {"avx512f", "avx512_vnni"}),
    "avx2": (("-mno-avx512f",), {"avx2"}),
    "portable": (("-mno-avx512f", "-mno-avx2"), set()),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_instruction_set_path_gives_the_torch_paths_bits(kernel, variant, tmp_path):
    extra_flags, needs = VARIANTS[variant]
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU has no {' / '.join(sorted(needs))}")
    library = native_build.build(native_linear.SOURCES, (*native_linear.FLAGS, *extra_flags), tmp_path)
    assert library is not None
    variant_kernel = native_linear.NativeLinear(library)
    assert variant_kernel.uses_amx == (variant == "amx")  # a refused AMX state would test AVX-512 twice
    generator = torch.Generator().manual_seed(7)
    for out_features, in_features in [(1536, 576), (40, 130), (21, 7)]:
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        layer = W8A8Linear(weight, bias=bias, kernel="native")
        reference = W8A8Linear(weight, bias=bias, kernel="fp32_exact")
        x = torch.randn(19, in_features, generator=generator) * 4
        x[3, 0] = 127.0  # one row whose max-abs value sits at the end of the int8 range
        packed, correction, _ = variant_kernel.pack(layer.integer_weight().to(torch.int8))  # its own layout
        out = variant_kernel.forward(x, packed, correction, layer.weight_scale, layer.bias)
        assert torch.equal(out, reference(x)), (variant, out_features, in_features)
        for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17):  # each row-tile remainder, one and several passes
            assert torch.equal(variant_kernel.forward(x[:rows], packed, correction, layer.weight_scale, layer.bias),
                               out[:rows])
    saturating = torch.full((64, 1536), -127, dtype=torch.int8)  # every weight -127
    x = torch.full((18, 1536), 1.0)  # every activation 127: |sums| far beyond int16; AMX takes 9+ rows
    expected = W8A8Linear(torch.full((64, 1536), -1.0), kernel="fp32_exact")(x)
    packed, correction, _ = variant_kernel.pack(saturating)
    out = variant_kernel.forward(x, packed, correction, torch.full((64,), 1 / 127), None)
    assert torch.equal(out, expected)


def test_weights_packed_for_the_other_layout_are_refused(kernel):
    native = native_linear.load()
    weight = torch.randint(-127, 128, (64, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    other, correction, _ = native_linear.pack(weight, not native.blocks_contiguous)
    with pytest.raises(ValueError, match="packed for the other layout"):
        native.forward(torch.randn(2, 40), other, correction, torch.ones(64), None)
