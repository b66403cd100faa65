"""A decoder's shape, read from a checkpoint and checked on construction."""

from dataclasses import dataclass

from pardec.runtime.architectures import ARCHITECTURES as SUPPORTED_ARCHITECTURES


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary scaling (rope_type "llama3"): frequencies whose wavelength exceeds
    original_max_position / low_freq_factor are divided by `factor`, those under
    original_max_position / high_freq_factor are kept, the band between is interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self):
        if self.factor <= 0 or self.original_max_position <= 0:
            raise ValueError("rope scaling: factor and original_max_position_embeddings must be positive")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("rope scaling: needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")


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
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim < 0:
            raise ValueError(f"head_dim must be positive (or 0: dim / n_heads), got {self.head_dim}")
        if not self.head_dim:
            if self.dim % self.n_heads:
                raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {self.head_dim}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("rope_theta and norm_eps must be positive")

    @property
    def q_dim(self) -> int:
        """Width of q and of attention's output: n_heads * head_dim (dim, but for Qwen3 shapes)."""
        return self.n_heads * self.head_dim
