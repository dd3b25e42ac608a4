"""A decoder's shape, from a preset or a Hugging Face `config.json`, and the one place for the
arithmetic every part of servesim takes from it: per-GPU GEMM shapes under tensor parallelism,
parameters, weight bytes per dtype, KV bytes per token.

Supported: dense Llama, Mistral, Qwen2 and Qwen3 decoders (GQA; QK-norm for Qwen3; Qwen2's q/k/v
biases). A config servesim cannot price (mixture of experts, sliding-window attention, MLA) is
refused with one line naming the file and the field. RoPE settings are read from either layout:
the hub's top-level `rope_theta`/`rope_scaling`, or the single `rope_parameters` object that
transformers 5 writes.

Tensor parallelism follows vLLM's layers (vllm/model_executor/layers/linear.py,
vocab_parallel_embedding.py): the QKV and gate-up GEMMs are column-parallel (heads and
intermediate size divided by T), O and down are row-parallel (their inputs divided by T), the
vocabulary is padded to a multiple of 64 and split, norms are replicated. With fewer KV heads than
GPUs, each GPU keeps one KV head (`ModelConfig.get_num_kv_heads` in vllm/config/model.py:
max(1, num_kv_heads // T)): KV heads are replicated, not split.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from sim.errors import ServesimError

DTYPE_BYTES = {"bf16": 2, "fp8": 1, "fp4": 0.5 + 1 / 16}  # weights (and GEMM inputs); fp4: nvfp4, an fp8 scale per 16
KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype: auto is the model's dtype (bf16)
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)

# model_type -> (architecture, QK-norm)
FAMILIES = {"llama": ("LlamaForCausalLM", False), "mistral": ("MistralForCausalLM", False),
            "qwen2": ("Qwen2ForCausalLM", False), "qwen3": ("Qwen3ForCausalLM", True)}
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
             "max_position_embeddings")


class Gemm(NamedTuple):
    """One per-layer matmul on one GPU: [tokens, k] x [k, n]."""

    name: str  # qkv, o, gate_up, down
    k: int
    n: int


def kv_cache_dtype_bytes(kv_cache_dtype: str, dtype: str = "bf16") -> int:
    """Bytes of one cached K or V element: `auto` keeps the model's activations' dtype (bf16,
    also under fp8 weights, as vLLM does), `fp8` one byte."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ServesimError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose auto or fp8")
    if dtype not in DTYPE_BYTES:
        raise ServesimError(f"unknown --dtype {dtype!r}; choose bf16 or fp8")
    return 1 if kv_cache_dtype == "fp8" else 2


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
    rope_scaling: dict | None = None  # Hugging Face's rope_scaling without rope_theta; None: plain RoPE
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # Qwen2's q/k/v projections carry biases

    def __post_init__(self) -> None:
        for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            value = getattr(self, field)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ServesimError(f"model {self.name}: {field} must be a positive whole number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ServesimError(
                f"model {self.name}: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ServesimError(f"model {self.name}: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ServesimError(f"model {self.name}: rope_theta must be positive, got {self.rope_theta}")

    # Construction.

    @classmethod
    def from_fields(cls, name: str, fields: dict) -> ModelConfig:
        """From a preset's dict (backends/presets.py)."""
        known = {f: fields[f] for f in cls.__dataclass_fields__ if f != "name" and f in fields}
        return cls(name=name, **known)

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        from backends.presets import get_model

        return cls.from_fields(name, get_model(name))

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """From a Hugging Face `config.json`, or a folder holding one."""
        where, raw = read_config_json(path)
        refuse_unpriceable(raw, where)
        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise ServesimError(f"{where}: model_type {model_type!r} is not supported; servesim prices dense "
                                f"{', '.join(FAMILIES)} decoders")
        fields = hf_fields(raw, where)
        for field in _REQUIRED:
            if field not in fields:
                raise ServesimError(f"{where}: no {field} in it")
        architecture, qk_norm = FAMILIES[model_type]
        architectures = raw.get("architectures")
        if isinstance(architectures, list) and architectures:
            architecture = str(architectures[0])
        fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
        if "head_dim" not in fields:
            fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        fields.setdefault("rope_theta", 10000.0)  # transformers' default for these families
        fields.setdefault("rope_scaling", None)
        name = Path(where).parent.name or str(where)
        try:
            return cls(name=name, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                       tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), qk_norm=qk_norm,
                       architecture=architecture, qkv_bias=model_type == "qwen2", **fields)
        except ServesimError as e:
            raise ServesimError(f"{where}: {e}") from None

    # Shapes.

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def check_tp(self, tp: int) -> None:
        """vLLM's divisibility rules for tensor parallelism of degree `tp`."""
        if not (isinstance(tp, int) and tp >= 1):
            raise ServesimError(f"--tp must be a whole number >= 1, got {tp!r}")
        nkv = self.num_key_value_heads
        rules = [(self.num_attention_heads % tp == 0, f"num_attention_heads ({self.num_attention_heads})"),
                 (nkv % tp == 0 if nkv >= tp else tp % nkv == 0, f"num_key_value_heads ({nkv})"),
                 (self.intermediate_size % tp == 0, f"intermediate_size ({self.intermediate_size})")]
        for ok, what in rules:
            if not ok:
                raise ServesimError(f"--tp {tp} does not split model {self.name}: its {what} cannot be divided "
                                    f"among {tp} GPUs")

    def num_kv_heads_per_gpu(self, tp: int = 1) -> int:
        return max(1, self.num_key_value_heads // tp)

    def gemms(self, tp: int = 1) -> list[Gemm]:
        """The per-layer matmuls on one GPU under tensor parallelism of degree `tp`: fused QKV and
        gate-up split by output columns, O and down by input rows (each then all-reduced)."""
        self.check_tp(tp)
        h, hd = self.hidden_size, self.head_dim
        heads = self.num_attention_heads // tp
        kv_heads = self.num_kv_heads_per_gpu(tp)
        i = self.intermediate_size // tp
        return [Gemm("qkv", h, (heads + 2 * kv_heads) * hd), Gemm("o", heads * hd, h),
                Gemm("gate_up", h, 2 * i), Gemm("down", i, h)]

    def padded_vocab(self, tp: int = 1) -> int:
        """Rows of the embedding (and LM head) on one GPU: the vocabulary padded to a multiple of
        64, split among the GPUs."""
        padded = -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        return -(-padded // tp)

    # Sizes.

    @property
    def num_parameters(self) -> int:
        """Parameters of the whole decoder (unpadded, one copy): embeddings, attention, MLP, norms,
        the LM head."""
        h, hd, layers = self.hidden_size, self.head_dim, self.num_hidden_layers
        linear = sum(g.k * g.n for g in self.gemms(1))
        per_layer = linear + 2 * h + (2 * hd if self.qk_norm else 0) + (self.q_size + 2 * self.kv_size
                                                                         if self.qkv_bias else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embeddings + h

    def weight_bytes_per_gpu(self, tp: int = 1, dtype: str = "bf16") -> int:
        """What one GPU holds of the weights, as vLLM loads them: the linear layers' shards in
        `dtype` (fp8: one byte per weight; the per-channel scales, 0.04% of a Llama, are left
        out), the padded vocabulary's shard of the embedding and LM head, norms and biases in bf16,
        and RoPE's cos/sin cache ([max_position_embeddings, head_dim] in bf16, built by vLLM's
        get_rope and counted in its "model loading took" figure)."""
        if dtype not in DTYPE_BYTES:
            raise ServesimError(f"unknown --dtype {dtype!r}; choose bf16 or fp8")
        h, hd, layers = self.hidden_size, self.head_dim, self.num_hidden_layers
        gemms = self.gemms(tp)
        linear = int(layers * sum(g.k * g.n for g in gemms) * DTYPE_BYTES[dtype])
        qkv_out = gemms[0].n
        small = layers * (2 * h + (2 * hd if self.qk_norm else 0) + (qkv_out if self.qkv_bias else 0)) + h
        embeddings = self.padded_vocab(tp) * h * (1 if self.tie_word_embeddings else 2)
        rope_cache = self.max_position_embeddings * hd
        return linear + 2 * (small + embeddings + rope_cache)

    def kv_bytes_per_token(self, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token over all layers, on one GPU."""
        return (2 * self.num_hidden_layers * self.num_kv_heads_per_gpu(tp) * self.head_dim
                * kv_cache_dtype_bytes(kv_cache_dtype))

    def describe(self) -> dict:
        """The fields, for summary.json."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


# Reading Hugging Face config files.


def read_config_json(path: str | Path) -> tuple[str, dict]:
    """(the file's path as text, its JSON object). `path` is the file or a folder holding it."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ServesimError(f"{p}: no such file (--model takes a preset name, a config.json or a folder holding one)")
    try:
        raw = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ServesimError(f"{p}: cannot read it as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ServesimError(f"{p}: not a JSON object")
    return str(p), raw


def refuse_unpriceable(raw: dict, where: str) -> None:
    """One line naming the field of a config that servesim's dense-decoder arithmetic cannot price."""
    for field in _MOE_FIELDS:
        if raw.get(field):
            raise ServesimError(f"{where}: {field} = {raw[field]}: mixture-of-experts models are not supported")
    for field in _MLA_FIELDS:
        if raw.get(field) is not None:
            raise ServesimError(f"{where}: {field} = {raw[field]}: multi-head latent attention is not supported")
    window = raw.get("sliding_window")
    if window is not None and raw.get("use_sliding_window", True) is not False:
        raise ServesimError(f"{where}: sliding_window = {window}: sliding-window attention is not supported")
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" in layer_types:
        raise ServesimError(f"{where}: layer_types has sliding_attention layers: sliding-window attention is not "
                            "supported")


def hf_fields(raw: dict, where: str) -> dict:
    """The shape fields present in a config.json (head_dim derived when absent or null), and the
    RoPE settings from either layout: `rope_theta` (float) and `rope_scaling` (None for plain
    RoPE) when the file states them. Both layouts at once must agree."""
    fields = {}
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        value = raw.get(field)
        if value is None:
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ServesimError(f"{where}: {field} = {value!r}, expected a positive whole number")
        fields[field] = value
    if "head_dim" not in fields and "hidden_size" in fields and "num_attention_heads" in fields:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    fields.update(_rope(raw, where))
    return fields


def _rope(raw: dict, where: str) -> dict:
    layouts = []
    if "rope_theta" in raw or "rope_scaling" in raw:
        layouts.append(("rope_theta/rope_scaling", raw.get("rope_theta"), raw.get("rope_scaling")))
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ServesimError(f"{where}: rope_parameters = {params!r}, expected an object")
        layouts.append(("rope_parameters", params.get("rope_theta"), params))
    found = []
    for label, theta, scaling in layouts:
        if theta is not None and not (isinstance(theta, (int, float)) and not isinstance(theta, bool)
                                      and math.isfinite(theta)):
            raise ServesimError(f"{where}: rope_theta = {theta!r}, expected a number")
        if scaling is not None and not isinstance(scaling, dict):
            raise ServesimError(f"{where}: rope_scaling = {scaling!r}, expected an object or null")
        found.append((label, None if theta is None else float(theta), _scaling(scaling)))
    if len(found) == 2 and found[0][1:] != found[1][1:] and found[0][1] is not None:
        raise ServesimError(f"{where}: its top-level rope_theta/rope_scaling ({found[0][1]}, {found[0][2]}) and "
                            f"rope_parameters ({found[1][1]}, {found[1][2]}) disagree")
    out = {}
    for _, theta, scaling in found:
        if theta is not None:
            out["rope_theta"] = theta
            out["rope_scaling"] = scaling
        elif scaling is not None:
            out["rope_scaling"] = scaling
    return out


def _scaling(scaling: dict | None) -> dict | None:
    """Hugging Face's scaling settings in one form: `rope_type` (older files say `type`), without
    rope_theta; None for plain RoPE."""
    if scaling is None:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    out["rope_type"] = rope_type
    return out


def resolve_model(name_or_path: str) -> ModelConfig:
    """A preset's name, or a path to a config.json (or a folder holding one)."""
    from backends.presets import MODELS

    if name_or_path in MODELS:
        return ModelConfig.from_preset(name_or_path)
    if Path(name_or_path).exists():
        return ModelConfig.from_hf(name_or_path)
    raise ServesimError(f"unknown model {name_or_path!r}: not a preset ({', '.join(MODELS)}; see `sim models`) "
                        "and no such config.json or folder")
