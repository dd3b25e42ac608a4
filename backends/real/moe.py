"""Mixture-of-experts layers of the real backend: Qwen3-MoE (`qwen3_moe`) and Mixtral (`mixtral`).

Routing, as Hugging Face transformers 5 computes it (models/qwen3_moe/modeling_qwen3_moe.py,
`Qwen3MoeTopKRouter.forward`; models/mixtral/modeling_mixtral.py, `MixtralTopKRouter.forward`):
router logits = h @ gate^T; probabilities = softmax over all experts in fp32; the top-k of them;
renormalised to sum to one when `norm_topk_prob` (Qwen3-MoE) and always for Mixtral. Mixtral's
"softmax over the top-k logits" is the same number: exp(l_i) / sum_topk exp(l_j) = p_i / sum_topk p_j.
Each chosen expert is a SwiGLU MLP, down(silu(gate(h)) * up(h)), and the layer's output is the
routing-weighted sum of its experts' outputs. Neither family has a shared expert
(`Qwen3MoeSparseMoeBlock` holds `experts` and `gate` only); a config with one is refused.
Qwen3-MoE places dense MLP layers as `Qwen3MoeDecoderLayer.__init__` does: layer i is sparse unless
i is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0; DeepSeek's `first_k_dense_replace`
(the first k layers dense) is honoured too.

Experts run as a grouped GEMM: the (token, slot) pairs are sorted by expert, so each expert's rows
are contiguous; one GEMM per expert over its rows (gate-up), SwiGLU, a second (down); then each
token's k rows are put back in order and summed with their routing weights. On the CPU the GEMMs
are torch matmuls, one per expert; on a GPU one Triton launch covers all experts
(kernels/grouped_gemm.py), with no host synchronisation, so decode steps are captured in CUDA graphs.
Weights are held as vLLM's fused MoE holds them: `w13` [E, 2 * I, H] (gate rows then up rows) and
`w2` [E, H, I].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.model_config import ModelConfig
from sim.errors import ServesimError

MOE_FAMILIES = ("qwen3_moe", "mixtral")  # model_type values whose MoE layers the real backend runs
COST_MODEL = "run it with --backend costmodel (the default), which prices it"


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    renormalize: bool  # top-k weights divided by their sum
    sparse_layers: frozenset[int]


def _field(cfg, name, default):
    value = getattr(cfg, name, default)
    return default if value is None else value


def moe_spec(cfg) -> MoeSpec | None:
    """The MoE shape of `cfg`, read from ModelConfig's MoE fields (getattr with defaults, so a
    ModelConfig without them is a dense model); None when it has no experts."""
    num_experts = int(_field(cfg, "num_experts", 0))
    if num_experts <= 0:
        return None
    model_type = _field(cfg, "model_type", "")
    top_k = int(_field(cfg, "num_experts_per_tok", 0))
    size = int(_field(cfg, "moe_intermediate_size", 0)) or cfg.intermediate_size
    if not 1 <= top_k <= num_experts:
        raise ServesimError(f"model {cfg.name}: num_experts_per_tok = {top_k}, expected 1 .. num_experts "
                            f"({num_experts})")
    renormalize = True if model_type == "mixtral" else bool(_field(cfg, "norm_topk_prob", False))
    sparse = sparse_layers(cfg.num_hidden_layers, int(_field(cfg, "first_k_dense_replace", 0)),
                           int(_field(cfg, "decoder_sparse_step", 1)) or 1, _field(cfg, "mlp_only_layers", ()))
    return MoeSpec(num_experts, top_k, size, renormalize, sparse)


def sparse_layers(num_layers: int, first_dense: int, step: int, mlp_only) -> frozenset[int]:
    """The layers with experts: from `first_dense` on (DeepSeek's first_k_dense_replace), every `step`-th
    (Qwen-MoE's decoder_sparse_step), but those of `mlp_only` (mlp_only_layers)."""
    only = set(mlp_only)
    return frozenset(i for i in range(num_layers) if i >= first_dense and i not in only and (i + 1) % step == 0)


def check_runnable_moe(cfg) -> None:
    """One line refusing what the real backend does not run: MLA, sliding windows, shared experts,
    MoE families other than Qwen3-MoE and Mixtral, and DeciLM's per-layer blocks (nemotron-nas); the
    cost model prices them."""
    if getattr(cfg, "has_layer_blocks", False):
        raise ServesimError(f"model {cfg.name}: DeciLM's per-layer blocks (model_type nemotron-nas: layers without "
                            f"attention or MLP, MLPs of their own widths) are not in the real backend; {COST_MODEL}")
    kv_lora_rank = getattr(cfg, "kv_lora_rank", None)
    if kv_lora_rank:
        raise ServesimError(f"model {cfg.name}: multi-head latent attention (kv_lora_rank = {kv_lora_rank}) is not "
                            f"in the real backend; {COST_MODEL}")
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or ()
    if window and (not layer_types or "sliding_attention" in layer_types):
        raise ServesimError(f"model {cfg.name}: sliding-window attention (sliding_window = {window}) is not in the "
                            f"real backend; {COST_MODEL}")
    if layer_types and any(t != "full_attention" for t in layer_types):
        other = next(t for t in layer_types if t != "full_attention")
        raise ServesimError(f"model {cfg.name}: layer_types has {other} layers, not in the real backend; {COST_MODEL}")
    # (found by a review: a Gemma whose layers are all full attention, or attention with biases, ran as a
    # plain Llama decoder, its greedy tokens not the checkpoint's)
    if getattr(cfg, "sandwich_norms", False):
        raise ServesimError(f"model {cfg.name}: Gemma's decoder (four norms a layer, scaled embeddings, GELU) is not "
                            f"in the real backend; {COST_MODEL}")
    if getattr(cfg, "attention_bias", False):
        raise ServesimError(f"model {cfg.name}: attention projections with biases (attention_bias) are not in the "
                            f"real backend; {COST_MODEL}")
    if int(_field(cfg, "num_experts", 0)) <= 0:
        return
    model_type = _field(cfg, "model_type", "")
    if model_type not in MOE_FAMILIES:
        raise ServesimError(f"model {cfg.name}: the real backend runs the experts of {' and '.join(MOE_FAMILIES)} "
                            f"models, not model_type {model_type!r}; {COST_MODEL}")
    shared = int(_field(cfg, "shared_expert_intermediate_size", 0))
    if shared:
        raise ServesimError(f"model {cfg.name}: shared experts (shared_expert_intermediate_size = {shared}) are not "
                            f"in the real backend; {COST_MODEL}")
    moe_spec(cfg)  # its own checks


@dataclass(frozen=True)
class MoeModelConfig(ModelConfig):
    """A ModelConfig carrying the MoE fields, under the names backends/model_config.py gives them,
    for configs built in code (the tests' tiny models, scripts/gpu_check.py) while that class may
    lack them. Redeclaring a field the base already has is allowed: the defaults here then apply."""

    model_type: str = ""
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    kv_lora_rank: int = 0  # MLA's; 0 is none
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int | None = None
    layer_types: tuple = ()


def tiny_moe(family: str, **overrides) -> MoeModelConfig:
    """A tiny model of each family (about 1M parameters): Qwen3-MoE with QK-norm, 8 experts, top-2
    renormalised (as Qwen3-30B-A3B's norm_topk_prob); Mixtral with 4 experts, top-2."""
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=512, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    if family == "qwen3_moe":
        fields = dict(common, name="tiny-qwen3-moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                      model_type="qwen3_moe", intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True)
    elif family == "mixtral":
        fields = dict(common, name="tiny-mixtral", architecture="MixtralForCausalLM", qk_norm=False,
                      model_type="mixtral", intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True, rope_theta=1e6)
    else:
        raise ValueError(family)
    fields.update(overrides)
    return MoeModelConfig(**fields)


# The layer.


def route(h: torch.Tensor, router: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights [T, k] fp32, expert ids [T, k] int64) of each row of h [T, H]."""
    probs = torch.softmax(F.linear(h, router).float(), dim=-1)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SortedRows:
    """The (token, slot) pairs of a step sorted by expert: row j of the sorted order is slot
    `order[j] % k` of token `order[j] // k`, and expert e's rows are [starts[e], starts[e] + counts[e])."""

    def __init__(self, ids: torch.Tensor, num_experts: int):
        flat = ids.reshape(-1)
        self.top_k = ids.shape[1]
        self.expert_ids, self.order = torch.sort(flat, stable=True)
        self.token_of_row = self.order // self.top_k
        # Per-expert counts without a host round trip (bincount would size its output from the max).
        edges = torch.searchsorted(self.expert_ids, torch.arange(num_experts + 1, device=ids.device))
        self.starts, self.counts = edges[:-1], edges[1:] - edges[:-1]

    def combine(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[T * k, H] expert outputs in sorted order -> [T, H]: each token's k rows weighted and summed (fp32)."""
        unsorted = torch.empty_like(rows).index_copy_(0, self.order, rows)
        t = weights.shape[0]
        return (unsorted.view(t, self.top_k, -1).float() * weights[:, :, None]).sum(dim=1).to(rows.dtype)


def torch_grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_rows: SortedRows) -> torch.Tensor:
    """a [R, K] rows sorted by expert, w [E, N, K] -> [R, N]: one matmul per expert over its contiguous rows."""
    out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    starts, counts = sorted_rows.starts.tolist(), sorted_rows.counts.tolist()
    for e, (start, n) in enumerate(zip(starts, counts)):
        if n:
            out[start:start + n] = F.linear(a[start:start + n], w[e])
    return out


def experts(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            grouped_gemm, silu_mul) -> torch.Tensor:
    """The experts' weighted sum for each row of h [T, H]: gather rows by expert, gate-up grouped GEMM,
    SwiGLU, down grouped GEMM, combine."""
    if h.shape[0] == 0:
        return torch.zeros_like(h)
    rows = SortedRows(ids, w13.shape[0])
    a = h[rows.token_of_row]  # [T * k, H], expert by expert
    down = grouped_gemm(silu_mul(grouped_gemm(a, w13, rows)), w2, rows)
    return rows.combine(down, weights)


def moe_forward(ops, h: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                spec: MoeSpec) -> torch.Tensor:
    weights, ids = route(h, router, spec)
    return experts(h, w13, w2, weights, ids, ops.grouped_gemm, ops.silu_mul)
