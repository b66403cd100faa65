"""The fp32 tree-attention kernel (verifier/tree_attention.c): right against torch's fp64
attention, and bit-identical per row whatever else is in the call."""

import functools
import shutil

import pytest
import torch

from pardec.verifier.kernels import native_attention, native_build
from pardec.verifier.model.attention import attend, step_mask
from pardec.verifier.kernels.native_attention import Layout, Storage

N_HEADS, N_KV_HEADS, HEAD_DIM = 9, 3, 64


@pytest.fixture(scope="module")
def kernel():
    loaded = native_attention.load()
    if loaded is None:
        # A compiler that rejects the source must fail here, not pass as a skip.
        assert shutil.which("cc") is None, "cc is on PATH but tree_attention.c did not build (see the log)"
        pytest.skip("no C compiler: the verifier runs attention in fp64")
    return loaded


def pool_storage(pool: torch.Tensor) -> Storage:
    # pool [2, n_kv_heads, slots, head_dim], as one layer of verifier.kvcache.KVPool
    return Storage(pool[0], pool[1], pool.stride(1), pool.stride(2))


def tree_ancestors(parents: list[int]) -> torch.Tensor:
    ancestors = torch.eye(len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
    return ancestors


def fp64_reference(queries, pool, slots, ancestors, start):
    keys, values = (pool[i][:, slots].double()[None] for i in (0, 1))
    out = attend(queries.double().transpose(0, 1)[None], keys, values, step_mask(ancestors, start), start)
    return out[0].transpose(0, 1).reshape(queries.shape[0], -1)


def test_matches_fp64_attention_on_scattered_slots(kernel):
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(2, N_KV_HEADS, 600, HEAD_DIM, generator=generator)
    parents = [-1, 0, 0, 1, 1, 2, 3, 1, 5]  # node i's parent; every parent comes before its children
    ancestors = tree_ancestors(parents)
    start = 131  # not a multiple of the kernel's key block: padding is exercised
    slots = torch.randperm(600, generator=generator)[: start + len(parents)]
    queries = torch.randn(len(parents), N_HEADS, HEAD_DIM, generator=generator)
    out = kernel.attend(queries, pool_storage(pool), Layout.build([start], [ancestors], [slots]), N_KV_HEADS)
    torch.testing.assert_close(out.double(), fp64_reference(queries, pool, slots, ancestors, start), rtol=0, atol=2e-6)


def test_a_row_is_bit_identical_alone_in_a_tree_and_next_to_other_sessions(kernel):
    generator = torch.Generator().manual_seed(1)
    pool = torch.randn(2, N_KV_HEADS, 400, HEAD_DIM, generator=generator)
    start = 70
    parents = [-1, 0, 0, 2, 1, 3]  # node 5's path: 0, 2, 3, 5
    ancestors = tree_ancestors(parents)
    tree_slots = torch.arange(start + len(parents))
    queries = torch.randn(len(parents), N_HEADS, HEAD_DIM, generator=generator)
    tree = kernel.attend(queries, pool_storage(pool), Layout.build([start], [ancestors], [tree_slots]), N_KV_HEADS)

    # The same path as a chain of its own, its keys at other slots holding the same values.
    path = [0, 2, 3, 5]
    moved = pool.clone()
    chain_slots = torch.arange(200, 200 + start + len(path))
    moved[:, :, chain_slots[:start]] = pool[:, :, tree_slots[:start]]
    moved[:, :, chain_slots[start:]] = pool[:, :, tree_slots[start + torch.tensor(path)]]
    chain = kernel.attend(queries[path], pool_storage(moved), Layout.build([start], [tree_ancestors([-1, 0, 1, 2])],
                          [chain_slots]), N_KV_HEADS)
    assert torch.equal(chain, tree[path])

    # With the path's first two positions committed: they are read as cache, not as the step.
    committed = kernel.attend(queries[path[2:]], pool_storage(moved),
                              Layout.build([start + 2], [tree_ancestors([-1, 0])], [chain_slots]), N_KV_HEADS)
    assert torch.equal(committed, tree[path[2:]])

    # Next to another session's 1-row step with a longer cache, in one call.
    other_slots = torch.arange(300, 391)
    other_query = torch.randn(1, N_HEADS, HEAD_DIM, generator=generator)
    both = kernel.attend(torch.cat([other_query, queries]), pool_storage(pool),
                         Layout.build([90, start], [tree_ancestors([-1]), ancestors], [other_slots, tree_slots]),
                         N_KV_HEADS)
    assert torch.equal(both[1:], tree)
    alone = kernel.attend(other_query, pool_storage(pool), Layout.build([90], [tree_ancestors([-1])], [other_slots]),
                          N_KV_HEADS)
    assert torch.equal(both[:1], alone)


def test_a_prompt_cut_into_chunks_anywhere_gives_the_same_rows(kernel):
    generator = torch.Generator().manual_seed(2)
    pool = torch.randn(2, N_KV_HEADS, 256, HEAD_DIM, generator=generator)
    slots = torch.arange(200)
    queries = torch.randn(200, N_HEADS, HEAD_DIM, generator=generator)
    whole = kernel.attend(queries, pool_storage(pool), Layout.build([0], [torch.ones(200, 200, dtype=torch.bool).tril()],
                          [slots]), N_KV_HEADS)
    for cut in (1, 63, 64, 65, 150):
        tail = 200 - cut
        part = kernel.attend(queries[cut:], pool_storage(pool),
                             Layout.build([cut], [torch.ones(tail, tail, dtype=torch.bool).tril()], [slots]), N_KV_HEADS)
        assert torch.equal(part, whole[cut:]), f"cut at {cut}"


def test_the_library_is_built_once_and_reused(tmp_path):
    build = functools.partial(native_build.build, (native_attention.SOURCE,), native_attention.FLAGS)
    first = build(tmp_path)
    if first is None:
        pytest.skip("no C compiler")
    stamp = first.stat().st_mtime_ns
    native_build.build.cache_clear()
    assert build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


def test_without_a_compiler_there_is_no_kernel(tmp_path):
    assert native_build.build((native_attention.SOURCE,), native_attention.FLAGS, tmp_path,
                              compiler="no-such-compiler-here") is None


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 48: AVX-512's 16 lanes, one vector at a time
def test_a_bf16_cache_gives_the_fp32_kernels_bits_on_the_same_numbers(kernel, head_dim):
    """The bf16 build widens each key and value exactly and computes as the fp32 build does: its
    output is bit-identical to the fp32 kernel's over the cache's values widened to fp32."""
    bf16 = native_attention.load(kv_dtype=torch.bfloat16)
    assert bf16 is not None and bf16.kv_dtype == torch.bfloat16
    generator = torch.Generator().manual_seed(2)
    pool = torch.randn(2, N_KV_HEADS, 300, head_dim, generator=generator).to(torch.bfloat16)
    parents = [-1, 0, 0, 1, 2, 4, 1]
    ancestors, start = tree_ancestors(parents), 97
    slots = torch.randperm(300, generator=generator)[: start + len(parents)]
    queries = torch.randn(len(parents), N_HEADS, head_dim, generator=generator)
    layout = Layout.build([start], [ancestors], [slots])
    got = bf16.attend(queries, pool_storage(pool), layout, N_KV_HEADS)
    assert torch.equal(got, kernel.attend(queries, pool_storage(pool.float()), layout, N_KV_HEADS))
    with pytest.raises(ValueError, match="reads a torch.bfloat16 cache"):
        bf16.attend(queries, pool_storage(pool.float()), layout, N_KV_HEADS)
