"""A decoder's shape, read from a checkpoint and checked on construction."""

from dataclasses import dataclass

from pardec.runtime.errors import ConfigError
from pardec.runtime.architectures import ARCHITECTURES as SUPPORTED_ARCHITECTURES


ROPE_KINDS = ("llama3", "yarn", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling a checkpoint states (rope_type), applied to theta^(-2i/d), each frequency:

    * "llama3" (Llama 3.1-3.3): wavelengths over original_max_position / low_freq_factor are divided
      by `factor`, those under original_max_position / high_freq_factor kept, the band between blended;
    * "yarn" (YaRN; Qwen2.5 and Qwen3 past 32K): frequencies that turn fewer than beta_slow times in
      original_max_position positions are divided by `factor`, those that turn more than beta_fast times
      kept, a linear ramp over the dimensions between; cos and sin are then scaled by attention_factor
      (the softmax's temperature);
    * "linear" (position interpolation): every frequency divided by `factor`.
    """

    kind: str
    factor: float
    original_max_position: int = 0  # llama3, yarn
    low_freq_factor: float = 0.0  # llama3
    high_freq_factor: float = 0.0
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ConfigError(f"rope scaling: kind {self.kind!r} must be one of {ROPE_KINDS}")
        if not self.factor > 0:
            raise ConfigError(f"rope scaling: factor must be positive, got {self.factor}")
        if self.kind != "linear" and self.original_max_position <= 0:
            raise ConfigError("rope scaling: original_max_position_embeddings must be positive")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError("rope scaling: needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.kind == "yarn" and not (self.beta_fast > 0 and self.beta_slow > 0 and self.attention_factor > 0):
            raise ConfigError("rope scaling: yarn's beta_fast, beta_slow and attention_factor must be positive")


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float
    norm_eps: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    # 0: dim // n_heads; Qwen3 states its own (q projects dim to n_heads * head_dim).
    head_dim: int = 0
    # Qwen3: an RMSNorm over each head of q and k (weights [head_dim]) before rotary.
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim < 0:
            raise ConfigError(f"head_dim must be positive (or 0: dim / n_heads), got {self.head_dim}")
        if not self.head_dim:
            if self.dim % self.n_heads:
                raise ConfigError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"rotary embedding needs an even head_dim, got {self.head_dim}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError("rope_theta and norm_eps must be positive")

    @property
    def q_dim(self) -> int:
        """Width of q and of attention's output: n_heads * head_dim (dim, but for Qwen3 shapes)."""
        return self.n_heads * self.head_dim
