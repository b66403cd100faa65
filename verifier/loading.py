"""Loading a served model: a checkpoint's tensors, prepared for W8A8 when they are float, built
into a Transformer on its device."""

import dataclasses
import logging

import torch

from pardec.runtime.errors import ConfigError
from pardec.runtime.memory import release_freed_memory
from pardec.verifier.model import ascend
from pardec.verifier.model.quant import choose_kernel
from pardec.verifier.model.transformer import Transformer, triton_available
from pardec.verifier.model.checkpoint import Checkpoint
from pardec.verifier.prepare.cache import CorruptEntry, PreparedCache, checkpoint_fingerprint
from pardec.verifier.prepare.precondition import precondition as preconditioned
from pardec.verifier.prepare.workers import Workers

log = logging.getLogger(__name__)


def load_model(
    ckpt: Checkpoint, quantization: str = "w8a8", device="cpu", kernel: str | None = None,
    precondition: bool = True, gptq: bool = True, attention: str = "auto",
    prepared_cache: PreparedCache | None = None, kv_dtype: torch.dtype | None = None,
    embedding_dtype: torch.dtype | None = None, positions: int | None = None,
) -> Transformer:
    """kernel: the W8A8 GEMM ("int_mm" or "fp32_exact"); None measures which is faster here.
    precondition: before W8A8 quantization, rotate the residual stream and smooth activation
    outliers into the weights (prepare/rotation.py, prepare/smoothing.py): the same float function,
    ~3x fewer top-1 changes against the float model. gptq (with precondition): pick the int8
    weights by GPTQ's error feedback (prepare/gptq.py) instead of rounding each to nearest. Both are
    off only to measure what they buy. attention: see ATTENTION_KERNELS; "auto" is the device
    engine ("triton") on CUDA with Triton, fixed_order on an Ascend NPU (which has no fp64; its
    W8A8 runs on the ops ascend.startup_ops checks there), fp64 on other devices. prepared_cache: where a float
    checkpoint's preparation is kept after its first load (prepare/cache.py); None prepares it
    every time. kv_dtype: what its KV pools store (Transformer's), None: the forward's own.
    embedding_dtype: what its embedding table is kept in (transformer.embedding_table), None: the
    narrowest dtype that holds the table exactly. positions: the most a session may hold (the
    verifier's max_seq_len), which its rotary tables and KV pools are sized by and refuse past;
    None: the model's context."""
    ascend_ops = None
    if torch.device(device).type == "npu":
        if kv_dtype is not None:
            raise ConfigError(f"kv_cache_dtype: only auto on {device} (its fixed-order path is tested with its own "
                              "fp32 cache only)")
        if attention not in ("auto", "fixed_order"):
            raise ConfigError(f"attention: {attention!r} cannot run on {device} (an Ascend NPU has no fp64, "
                              "CUDA or C kernels): use auto or fixed_order")
        attention = "fixed_order"
        if quantization == "w8a8":
            kernel, ascend_ops = "npu_quant_matmul", ascend.startup_ops(device)
    elif attention == "auto" and torch.device(device).type == "cuda" and quantization == "w8a8" and triton_available():
        attention = "triton"
    elif attention == "auto" and torch.device(device).type != "cpu":
        attention = "fp64"
    if attention == "triton":
        if quantization != "w8a8":
            raise ValueError("attention 'triton' (the device engine) serves w8a8 models only")
        if kv_dtype not in (None, torch.bfloat16):  # refused before a float checkpoint's preparation
            raise ConfigError(f"kv_cache_dtype: the device engine stores keys and values in bfloat16, not {kv_dtype}")
        kernel = "int_mm"  # int8 weights on the device, exact int32 sums
    if quantization == "w8a8" and kernel is None:
        kernel = choose_kernel(device)
    tensors = ckpt.tensors
    how = (quantization, kernel, attention, device, ascend_ops, kv_dtype, embedding_dtype, positions)  # _built's
    # An int8 checkpoint's weights are used as stored: rotating or smoothing would requantize them.
    # Calibration runs the float model with fp64 attention, so the int8 weights are the same
    # on every host, whichever attention kernel serves.
    if quantization == "w8a8" and precondition and not ckpt.prequantized:
        def prepare():
            # Every op on one thread: float reductions split over threads round differently, and
            # replicas with other thread counts (or on other hosts, without a shared cache) must
            # serve the same int8 weights, or a session moved between them could change its
            # tokens. Independent pieces run side by side on that many threads (workers.py).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with Workers(threads) as workers:
                    return preconditioned(ckpt.args, ckpt.tensors, ckpt.tokenizer, gptq, workers)
            finally:
                torch.set_num_threads(threads)

        if prepared_cache is not None and ckpt.source:
            key = prepared_cache.key(checkpoint_fingerprint(ckpt.source), {"gptq": gptq})
            try:
                return _built(ckpt, prepared_cache.prepared(key, prepare), *how)
            except CorruptEntry as error:
                log.warning("prepared-weight cache: %s; preparing again", error)
                damaged = error
            # Outside the except block, so its traceback does not keep the half-built model alive.
            prepared_cache.discard(key, damaged)
            return _built(ckpt, prepared_cache.prepared(key, prepare), *how)
        tensors = prepare()
    return _built(ckpt, tensors, *how)


def _built(ckpt: Checkpoint, tensors, quantization: str, kernel: str | None, attention: str, device,
           ascend_ops: "ascend.AscendOps | None" = None, kv_dtype: torch.dtype | None = None,
           embedding_dtype: torch.dtype | None = None, positions: int | None = None) -> Transformer:
    args = ckpt.args
    if positions is not None and positions < args.max_position:
        # A YaRN model's 131072 positions of rotary tables are 128 MiB; a position's entries are the
        # same numbers at any table length.
        args = dataclasses.replace(args, max_position=positions)
    model = Transformer(args, tensors, quantization, kernel or "fp32_exact", attention,
                        ascend_ops, kv_dtype, embedding_dtype).to(device).eval()
    del tensors
    release_freed_memory()  # the checkpoint's or the cache's copies the model no longer needs
    return model
