"""The verifier's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import os

from jinja2.exceptions import TemplateError, TemplateSyntaxError

from pardec.runtime.draft_params import MAX_TREE_NODES
from pardec.runtime.errors import ConfigError
from pardec.runtime.security import ServerTLS
from pardec.runtime.tracing import check_endpoint
from pardec.verifier.api import MAX_MODEL_NAME, valid_model_name
from pardec.verifier.chat_template import template_environment
from pardec.verifier.generation_config import check_setting

QUANTIZATIONS = ("w8a8", "none")
# "native": the fp32 fixed-order CPU kernel (native_attention.py), "fp64": torch's attention in
# float64, "triton": the device engine (device_forward.py: fp32 Triton attention over bf16 keys
# and values, int8 GEMMs, CUDA graphs), "fixed_order": fp32 torch ops with every reduction in a
# fixed order (fixed_order.py; what an Ascend NPU, without fp64, runs), "auto": native on the CPU
# when it builds (a C compiler), triton on CUDA, fixed_order on an NPU, else fp64.
ATTENTION_KERNELS = ("auto", "native", "fp64", "triton", "fixed_order")
DEVICE_TYPES = ("cpu", "cuda", "npu")
# What the KV pool may store (vLLM's --kv-cache-dtype names): "auto", the forward's own.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
# What the embedding table may be kept in: "auto", the narrowest dtype holding it exactly.
EMBEDDING_DTYPES = ("auto", "bfloat16", "float32")
MAX_CHAT_TEMPLATE_CHARS = 1024 * 1024  # the largest real templates are tens of KB


def parse_device(device: str) -> tuple[str, int | None]:
    """'cpu' -> ('cpu', None); 'cuda:1' -> ('cuda', 1); anything else is a ConfigError."""
    kind, _, index = device.partition(":")
    if kind not in DEVICE_TYPES or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise ConfigError(f"device: {device!r} must be cpu, cuda[:N] or npu[:N]")
    return kind, int(index) if index else None


def read_chat_template(value: str) -> str:
    """--chat-template's template, as vLLM takes it: the file it names, else the value itself where
    it is a template; a value that is neither is a ConfigError. A file is UTF-8 (a byte-order mark
    is not template text) and at most MAX_CHAT_TEMPLATE_CHARS long.

    >>> read_chat_template("{{ messages[0].content }}"), read_chat_template("")
    ('{{ messages[0].content }}', '')
    """
    if not value or (not os.path.exists(value) and ("{{" in value or "{%" in value)):
        return value
    try:
        with open(value, encoding="utf-8-sig") as file:
            return file.read(MAX_CHAT_TEMPLATE_CHARS + 1)  # the config refuses more
    except OSError as error:
        raise ConfigError(f"chat_template: cannot read {value!r}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"chat_template: {value!r} is not UTF-8 text") from None


@dataclass(frozen=True)
class VerifierConfig:
    # GGUF file or Hugging Face checkpoint directory; None = the bundled SmolLM2-135M-Instruct.
    model_path: str | None = None
    # The model's name in every reply and the OpenAI API's `model` (MindIE's ModelConfig[0].modelName,
    # vLLM's --served-model-name); "": the checkpoint's own (a GGUF's general.name).
    served_model_name: str = ""
    # A chat template (Jinja text) served in place of the checkpoint's own (vLLM's --chat-template:
    # a model without one, tools in another layout); "": the checkpoint's.
    chat_template: str = ""
    # The sampling defaults of HTTP requests that leave those fields out (vLLM's
    # --generation-config): "auto", the model directory's generation_config.json if it has one,
    # else its config.json's sampling fields;
    # "none" (vLLM's "vllm" too); or a directory holding one (generation_config.py).
    generation_config: str = "auto"
    # "w8a8" serves; "none" (float) exists as a correctness reference.
    quantization: str = "w8a8"
    # One model worker per device; sessions stay on the worker that prefilled them. `devices`
    # (e.g. ("npu:0", "npu:1")) overrides `device` when given.
    device: str = "cpu"
    devices: tuple[str, ...] = ()
    # Longest sequence a session may hold: prompt + generated + one step's tree (maxSeqLen).
    max_seq_len: int = 2560
    # Longest prompt accepted (maxInputTokenLen).
    max_input_tokens: int = 2048
    # Most draft nodes one verify call may carry; by default what the drafter proposes at most
    # (runtime/draft_params.py), where MindIE's largest lookahead tree fits.
    max_tree_nodes: int = MAX_TREE_NODES
    # Concurrent sessions held (per worker), prompts waiting for admission included; more get
    # RESOURCE_EXHAUSTED at once.
    max_sessions: int = 64
    # How long a prompt may wait for the KV pool to promise it what it may use (the caller said
    # max_new_tokens) before RESOURCE_EXHAUSTED; 0 = refuse at once, so that a gateway with
    # several replicas tries the next one straight away.
    admission_wait_s: float = 0.0
    # A session untouched for this long is released (its client vanished); the engine checks
    # on its own clock, not only when new work arrives.
    session_idle_s: float = 600.0
    # torch intra-op threads; 0 = torch's default.
    threads: int = 0
    # On CPU, run each forward on fewer of those threads when that is faster (the CPUs are
    # shared with other busy processes): engine/threads.py. False: every forward uses them all.
    adapt_threads: bool = True
    # Attention kernel, one of ATTENTION_KERNELS ("native" fails at startup without a compiler).
    # Each keeps every logit independent of the batch; their logits differ in the last bits.
    attention: str = "auto"
    # Continuous batching: one forward takes the queued steps of many sessions, up to this many
    # tokens (a tree larger than this still runs, alone). Prompts are cut into chunks that fill
    # what the verify steps leave, so a long prefill does not stall everyone's decoding.
    max_batch_tokens: int = 512
    # Most sessions in one forward; 1 turns batching off (one session's step per forward).
    max_batch_sessions: int = 64
    # How long the engine may hold the queued steps for the other live sessions' steps to join
    # the forward, counted from when the previous forward's results went out (or the oldest step's
    # arrival, if later): at most batch_wait_ms and at most batch_wait_share of the previous
    # forward's time, so a session that does not come back costs the others little. It stops
    # waiting as soon as every live session has a step queued. 0 = take what is queued.
    # A session's gap between a result and its next step (gateway, drafter) is short next to a
    # forward of many sessions, and a forward of half the sessions costs most of a full one, so
    # gathering them pays many times over (figures: docs/benchmarks.md).
    batch_wait_ms: float = 20.0
    batch_wait_share: float = 0.15
    # KV cache pool, preallocated (per worker): positions of all sessions together. Each costs
    # n_layers * 2 * n_kv_heads * head_dim * 4 bytes in fp32, 2 in bf16 (46 / 23 KB for
    # SmolLM2-135M: 3 GB at 65536 in fp32); pages are committed only as blocks are first used.
    # Full -> RESOURCE_EXHAUSTED.
    kv_pool_tokens: int = 65536
    # What the KV pool stores (vLLM's --kv-cache-dtype): "auto", the forward's own (fp32 on CPU, bf16
    # in the device engine); "bfloat16" halves the pool's bytes and its reads on CPU, each key and
    # value rounded once as it is stored (a different model function from fp32's in the last bits,
    # served lossless alike); "float32".
    kv_cache_dtype: str = "auto"
    # What the embedding table is kept in: "auto", bf16 (or fp16) where that holds every entry
    # exactly (a checkpoint used as stored: compressed-tensors, msModelSlim), else fp32 (a prepared
    # checkpoint's rotated table); "bfloat16" halves a prepared table too, each entry rounded once
    # (a different model function in the last bits, served lossless alike); "float32".
    embedding_dtype: str = "auto"
    # Where each Prefill's span goes over OTLP/gRPC (runtime/tracing.py; the gateway's flag too):
    # a child of the gateway's request span. "": no tracing.
    otlp_traces_endpoint: str = ""
    # Positions per pool block: the unit of allocation (a session wastes < 1 block).
    kv_block_tokens: int = 32
    # Keep the full KV blocks of finished prompts and conversations findable by their tokens, so
    # that a prompt starting the same way computes only the rest (prefix_cache.py). Exact: the
    # cached keys and values are the numbers its own prefill would write.
    prefix_caching: bool = True
    # Measure the step cost curve at startup (a few seconds) for ModelInfo.cost_curve.
    measure_cost_curve: bool = True
    # Where a float checkpoint's W8A8 preparation is kept after its first load (prepare/cache.py):
    # None: the user's cache ($XDG_CACHE_HOME/pardec or ~/.cache/pardec, resolved at startup);
    # "": no cache, prepare at every start.
    prepared_cache_dir: str | None = None
    # TLS of the verifier's port (None: plaintext); with a client CA, mutual TLS.
    tls: ServerTLS | None = None

    def __post_init__(self) -> None:
        check_setting(self.generation_config)
        if self.served_model_name and not valid_model_name(self.served_model_name):
            raise ConfigError(f"served_model_name: {self.served_model_name[:80]!r} must be 1 to {MAX_MODEL_NAME} "
                              "printable characters, without leading or trailing spaces")
        if len(self.chat_template) > MAX_CHAT_TEMPLATE_CHARS:
            raise ConfigError(f"chat_template: {len(self.chat_template)} characters; at most {MAX_CHAT_TEMPLATE_CHARS}")
        try:  # compiled as it is served: an unknown filter is found now, not at the first request
            template_environment().from_string(self.chat_template)
        except TemplateSyntaxError as error:
            raise ConfigError(f"chat_template: not a Jinja template: {error.message} (line {error.lineno})") from None
        except TemplateError as error:
            raise ConfigError(f"chat_template: not a Jinja template: {error}") from None
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization: {self.quantization!r} is not one of {QUANTIZATIONS}")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"attention: {self.attention!r} is not one of {ATTENTION_KERNELS}")
        check_endpoint(self.otlp_traces_endpoint)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {tuple(KV_CACHE_DTYPES)}")
        if self.embedding_dtype not in EMBEDDING_DTYPES:
            raise ConfigError(f"embedding_dtype: {self.embedding_dtype!r} is not one of {tuple(EMBEDDING_DTYPES)}")
        for device in self.worker_devices:
            parse_device(device)
        if len(set(self.worker_devices)) != len(self.worker_devices):
            raise ConfigError(f"devices: {self.devices!r} lists a device twice")
        if self.max_input_tokens < 1 or self.max_seq_len <= self.max_input_tokens:
            raise ConfigError(
                f"max_seq_len ({self.max_seq_len}) must exceed max_input_tokens ({self.max_input_tokens}) >= 1"
            )
        for name in ("max_tree_nodes", "max_sessions", "max_batch_tokens", "max_batch_sessions", "kv_block_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.admission_wait_s <= 3600:
            raise ConfigError(f"admission_wait_s: must be in [0, 3600], got {self.admission_wait_s}")
        if not self.session_idle_s > 0 or self.threads < 0:  # "not >": NaN is refused too
            raise ConfigError(f"session_idle_s must be > 0 and threads >= 0, got {self.session_idle_s} and {self.threads}")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ConfigError(f"batch_wait_ms: must be in [0, 1000], got {self.batch_wait_ms}")
        if not 0 <= self.batch_wait_share <= 1:
            raise ConfigError(f"batch_wait_share: must be in [0, 1], got {self.batch_wait_share}")
        # One session at max_seq_len must fit, with the block it may round up to.
        if self.kv_pool_tokens < self.max_seq_len + self.kv_block_tokens:
            raise ConfigError(
                f"kv_pool_tokens ({self.kv_pool_tokens}) must hold one session of max_seq_len "
                f"({self.max_seq_len}) plus one block ({self.kv_block_tokens})"
            )

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return self.devices or (self.device,)
