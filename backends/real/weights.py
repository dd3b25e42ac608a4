"""The decoder's weights: random with a fixed seed, or read from a local safetensors folder with
Hugging Face tensor names. Nothing is downloaded.

Hugging Face keeps q/k/v and gate/up as separate tensors, and each expert's tensors apart; the
model holds them fused (experts as [E, out, in]), so each name maps to a view of a fused parameter.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from backends.model_config import ModelConfig, hf_fields, read_config_json
from backends.real.model import Decoder
from backends.real.moe import moe_spec, sparse_layers
from sim.errors import ServesimError

# config.json fields that must agree with the preset for a folder to be this model.
_CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size")
LOADED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # the weights' dtypes it loads
# Tensors a checkpoint may carry that the model does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@torch.no_grad()
def init_random(model: Decoder, seed: int) -> None:
    """Matrices ~ N(0, 1/fan_in) (embeddings N(0, 1); experts' [E, out, in] the same per expert), norm
    weights ~ 1 + N(0, 0.1^2): activations keep unit scale through the layers, and every norm weight
    matters to the result."""
    device = model.embed_tokens.device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.normal_(1.0, 0.1, generator=gen)
        elif name == "embed_tokens":
            p.normal_(0.0, 1.0, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


def _moe_names(cfg) -> tuple[str, str, str, str, str]:
    """(block, router, gate, up, down) of a checkpoint's MoE tensors, as the hub's files name them:
    Mixtral `block_sparse_moe.gate`, `experts.{e}.w1` (gate) / `w3` (up) / `w2` (down); Qwen3-MoE
    `mlp.gate`, `experts.{e}.gate_proj` / `up_proj` / `down_proj` (transformers' conversion_mapping.py
    turns both into its fused `experts.gate_up_proj` and `experts.down_proj`)."""
    if getattr(cfg, "model_type", "") == "mixtral":
        return "block_sparse_moe", "gate", "w1", "w3", "w2"
    return "mlp", "gate", "gate_proj", "up_proj", "down_proj"


def hf_layout(model: Decoder) -> dict[str, torch.Tensor]:
    """Hugging Face tensor name -> the view of the model's (possibly fused) parameter that holds it."""
    cfg = model.cfg
    q, kv = cfg.q_size, cfg.kv_size
    layout = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm}
    if model.lm_head is not None:
        layout["lm_head.weight"] = model.lm_head
    block, router, gate, up, down = _moe_names(cfg)
    for n, layer in enumerate(model.layers):
        pre = f"model.layers.{n}."
        layout[pre + "input_layernorm.weight"] = layer.input_layernorm
        layout[pre + "self_attn.q_proj.weight"] = layer.qkv_proj[:q]
        layout[pre + "self_attn.k_proj.weight"] = layer.qkv_proj[q:q + kv]
        layout[pre + "self_attn.v_proj.weight"] = layer.qkv_proj[q + kv:q + 2 * kv]
        if layer.q_norm is not None:
            layout[pre + "self_attn.q_norm.weight"] = layer.q_norm
            layout[pre + "self_attn.k_norm.weight"] = layer.k_norm
        layout[pre + "self_attn.o_proj.weight"] = layer.o_proj
        layout[pre + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
        if layer.moe is None:
            i = cfg.intermediate_size
            layout[pre + "mlp.gate_proj.weight"] = layer.gate_up_proj[:i]
            layout[pre + "mlp.up_proj.weight"] = layer.gate_up_proj[i:2 * i]
            layout[pre + "mlp.down_proj.weight"] = layer.down_proj
            continue
        i = layer.moe.intermediate_size
        layout[f"{pre}{block}.{router}.weight"] = layer.router
        for e in range(layer.moe.num_experts):
            ex = f"{pre}{block}.experts.{e}."
            layout[ex + f"{gate}.weight"] = layer.w13[e, :i]
            layout[ex + f"{up}.weight"] = layer.w13[e, i:2 * i]
            layout[ex + f"{down}.weight"] = layer.w2[e]
    return layout


def hf_state_dict(model: Decoder) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (fused tensors split), e.g. to save a checkpoint."""
    return {name: view.clone() for name, view in hf_layout(model).items()}


def _open_safetensors():
    try:
        from safetensors import safe_open
    except ImportError:
        raise ServesimError("--weights needs the safetensors package: pip install -e '.[real]'") from None
    return safe_open


def _open_file(safe_open, path: Path):
    """One safetensors file; a corrupt one (bad header, cut short) is a user error naming it."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError, or OSError
        raise ServesimError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _check_config(folder: Path, cfg: ModelConfig) -> None:
    """A folder's config.json, read as `--model` reads one (either RoPE layout), must describe the
    model the weights are loaded into: the fields it states must agree."""
    if not (folder / "config.json").exists():
        return
    where, raw = read_config_json(folder)
    stated = hf_fields(raw, where)
    for field in (*_CONFIG_FIELDS, "rope_theta", "rope_scaling"):
        if field in stated and stated[field] != getattr(cfg, field):
            raise ServesimError(f"weights folder {folder} does not match model {cfg.name}: its config.json has "
                                f"{field} = {stated[field]}, the model {getattr(cfg, field)}")
    # What the computation reads besides the shapes (found by a review: these were not compared, so a
    # folder of another norm epsilon, tied embeddings or routing loaded without a word).
    if raw.get("rms_norm_eps") is not None and not math.isclose(float(raw["rms_norm_eps"]), cfg.rms_norm_eps,
                                                                rel_tol=1e-9):
        raise ServesimError(f"weights folder {folder} does not match model {cfg.name}: its config.json has "
                            f"rms_norm_eps = {raw['rms_norm_eps']}, the model {cfg.rms_norm_eps}")
    if raw.get("tie_word_embeddings") is not None and bool(raw["tie_word_embeddings"]) != cfg.tie_word_embeddings:
        raise ServesimError(f"weights folder {folder} does not match model {cfg.name}: its config.json has "
                            f"tie_word_embeddings = {str(bool(raw['tie_word_embeddings'])).lower()}, the model "
                            f"{str(cfg.tie_word_embeddings).lower()}")
    act = raw.get("hidden_act", raw.get("hidden_activation"))
    if act is not None and act != "silu":
        raise ServesimError(f"weights folder {folder}: its config.json has hidden_act = {act!r}; the real backend's "
                            "MLPs run SiLU")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ServesimError(f"weights folder {folder}: its config.json has {flag} = true; the real backend's "
                                "projections have no biases")
    spec = moe_spec(cfg)
    if spec is None:
        return
    if "norm_topk_prob" in raw and raw.get("model_type") != "mixtral" and bool(raw["norm_topk_prob"]) != spec.renormalize:
        raise ServesimError(f"weights folder {folder} does not match model {cfg.name}: its config.json has "
                            f"norm_topk_prob = {str(bool(raw['norm_topk_prob'])).lower()}, the model "
                            f"{str(spec.renormalize).lower()}")
    step = raw.get("decoder_sparse_step", 1) or 1
    only = raw.get("mlp_only_layers") or []
    first = raw.get("first_k_dense_replace", 0) or 0
    if isinstance(step, int) and isinstance(first, int) and isinstance(only, list):
        sparse = sparse_layers(cfg.num_hidden_layers, first, step, only)
        if sparse != spec.sparse_layers:
            raise ServesimError(f"weights folder {folder} does not match model {cfg.name}: its config.json puts "
                                f"experts in {len(sparse)} of {cfg.num_hidden_layers} layers (decoder_sparse_step, "
                                f"mlp_only_layers), the model in {len(spec.sparse_layers)}")
    # Mixtral names the expert count num_local_experts, Qwen3-MoE num_experts.
    for names, value in ((("num_experts", "num_local_experts"), spec.num_experts),
                         (("num_experts_per_tok",), spec.top_k), (("moe_intermediate_size",), spec.intermediate_size)):
        for name in names:
            if isinstance(raw.get(name), int) and raw[name] != value:
                raise ServesimError(f"weights folder {folder} does not match model {cfg.name}: its config.json has "
                                    f"{name} = {raw[name]}, the model {value}")


@torch.no_grad()
def load_safetensors(model: Decoder, folder: str | Path) -> None:
    """Fill the model from every `*.safetensors` file in `folder`; any missing, unexpected or
    misshapen tensor is a `ServesimError` naming it."""
    folder = Path(folder)
    cfg = model.cfg
    if not folder.is_dir():
        raise ServesimError(f"--weights {folder}: not a folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ServesimError(f"--weights {folder}: no *.safetensors files in it")
    _check_config(folder, cfg)
    safe_open = _open_safetensors()
    layout = hf_layout(model)
    handles = {f: _open_file(safe_open, f) for f in files}
    where: dict = {}
    for f, h in handles.items():
        for name in h.keys():
            if name in where:  # (found by a review: a stale extra shard's copy replaced the other silently)
                raise ServesimError(f"weights folder {folder}: tensor {name} is in both {where[name][1].name} and "
                                    f"{f.name}; a checkpoint holds each tensor once")
            where[name] = (h, f)
    missing = [n for n in layout if n not in where]
    unexpected = [n for n in where if n not in layout and not n.endswith(_IGNORED_SUFFIXES)
                  and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    for names, what in ((missing, "lacks"), (unexpected, "has a tensor the model does not use,")):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise ServesimError(f"weights folder {folder} does not match model {cfg.name}: it {what} "
                                f"{names[0]}{more}")
    for name, view in layout.items():
        handle, file = where[name]
        try:
            tensor = handle.get_tensor(name)
        except Exception as e:  # safetensors' own error type: a header that lies about the data
            raise ServesimError(f"{file}: cannot read tensor {name} ({type(e).__name__}: {e})") from None
        if tuple(tensor.shape) != tuple(view.shape):
            raise ServesimError(f"weights folder {folder} does not match model {cfg.name}: {name} has shape "
                                f"{list(tensor.shape)}, the preset needs {list(view.shape)}")
        if tensor.dtype not in LOADED_DTYPES:
            # (found by a review: fp8 ended in an internal error; integers, booleans and complex numbers were cast)
            raise ServesimError(f"{file}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}: the real "
                                "backend loads unquantized weights (bf16, fp16 or fp32); a quantized checkpoint is "
                                "priced by the cost model (--backend costmodel)")
        if not bool(torch.isfinite(tensor).all()):
            # (a NaN or infinite weight makes every logit NaN: the steps would run, and sample nonsense)
            bad = int((~torch.isfinite(tensor)).sum())
            raise ServesimError(f"{file}: tensor {name} holds {bad} NaN or infinite value{'s' * (bad != 1)} of "
                                f"{tensor.numel()}; a checkpoint's weights are finite")
        view.copy_(tensor)
