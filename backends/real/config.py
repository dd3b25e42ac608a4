"""The decoder's shape, read from a model preset (Hugging Face `config.json` fields)."""

from __future__ import annotations

from dataclasses import dataclass

from backends.presets import get_model
from sim.errors import ServesimError


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool
    rope_scaling: dict | None = None  # Hugging Face's `rope_scaling` (Llama 3.1's "llama3"); None: plain RoPE

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ServesimError(
                f"model {self.name}: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ServesimError(f"model {self.name}: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") != "llama3":
            raise ServesimError(f"model {self.name}: rope_scaling type {self.rope_scaling.get('rope_type')!r} is not "
                                "supported (only llama3)")

    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        preset = get_model(name)
        return cls(name=name, **{f: preset.get(f) for f in cls.__dataclass_fields__ if f != "name"})

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim
