"""Small synthetic operator tables in AIConfigurator's layout, for tests that need no GPU data.

Times are simple closed forms so tests can compute expected values by hand:
GEMM latency (ms) = 0.002 + m * n * k * 1e-9 (fp8: half the second term); context attention
(ms) = 0.01 + batch * isl^2 * 1e-7; generation attention (ms) = 0.01 + batch * (step + 1) * 1e-5;
all-reduce (ms) = 0.005 (graph) or 0.02 (eager) + bytes * 1e-8.
"""

from __future__ import annotations

import itertools

import pandas as pd

from backends.costmodel.optables.tables import TableSet

GEMM_GRID = [64, 128, 256, 512]
M_GRID = [1, 2, 4, 8, 16, 64, 256, 1024]
HEADS = [(4, 2, 32), (2, 1, 32)]  # (heads, KV heads, head_dim) of TINY at TP 1 and TP 2
CTX_BATCH, CTX_ISL = [1, 2, 4], [16, 64, 256]
GEN_BATCH, GEN_STEP = [1, 2, 4, 8], [1, 15, 255]
AR_SIZES = [2**i for i in range(7, 27)]

TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512}


def gemm_ms(m, n, k, dtype="bfloat16"):
    return 0.002 + m * n * k * 1e-9 * (0.5 if dtype == "fp8" else 1.0)


def ctx_ms(batch, isl):
    return 0.01 + batch * isl * isl * 1e-7


def gen_ms(batch, step):
    return 0.01 + batch * (step + 1) * 1e-5


def ar_ms(size, graph=True):
    return (0.005 if graph else 0.02) + size * 1e-8


def frames() -> dict[str, pd.DataFrame]:
    kernels = {"bfloat16": "torch.nn.functional.linear", "fp8": "CutlassFP8ScaledMMLinearKernel"}
    gemm = pd.DataFrame([{"kernel_source": kernels[d], "gemm_dtype": d, "m": m, "n": n, "k": k,
                          "latency": gemm_ms(m, n, k, d), "device": "Synthetic GPU"}
                         for d in kernels for m, n, k in itertools.product(M_GRID, GEMM_GRID, GEMM_GRID)])
    common = {"kernel_source": "vllm_flash_attn_fa3", "kv_cache_dtype": "bfloat16", "window_size": 0}
    ctx = pd.DataFrame([dict(common, batch_size=b, isl=s, num_heads=h, num_key_value_heads=kv, head_dim=hd, step=0,
                             latency=ctx_ms(b, s))
                        for (h, kv, hd), b, s in itertools.product(HEADS, CTX_BATCH, CTX_ISL)
                        if not (b == 4 and s == 256)])  # triangular, as the real tables
    gen = pd.DataFrame([dict(common, batch_size=b, isl=1, num_heads=h, num_key_value_heads=kv, head_dim=hd, step=s,
                             latency=gen_ms(b, s))
                        for (h, kv, hd), b, s in itertools.product(HEADS, GEN_BATCH, GEN_STEP)
                        if not (b == 8 and s == 255)])
    # The same kernels over an fp8 KV cache: a decode reads half the bytes.
    ctx = pd.concat([ctx, ctx.assign(kv_cache_dtype="fp8", latency=ctx["latency"] * 0.9)], ignore_index=True)
    gen = pd.concat([gen, gen.assign(kv_cache_dtype="fp8", latency=gen["latency"] * 0.6)], ignore_index=True)
    ar = pd.DataFrame([{"kernel_source": f"vLLM_custom_{mode}", "num_gpus": 2, "message_size": size,
                        "latency": ar_ms(size, mode == "graph")}
                       for mode in ("graph", "eager") for size in AR_SIZES])
    return {"gemm": gemm, "context_attention": ctx, "generation_attention": gen, "custom_allreduce": ar}


def write_tables(folder, system="tiny_gpu", fmt="csv") -> None:
    for kind, frame in frames().items():
        path = folder / f"{system}__vllm-0.24.0__{kind}_perf.{fmt}"
        frame.to_csv(path, index=False) if fmt == "csv" else frame.to_parquet(path)


def table_set() -> TableSet:
    out = {}
    for kind, frame in frames().items():
        frame = frame.copy()
        frame["seconds"] = frame["latency"] * 1e-3
        out[kind] = frame
    return TableSet("tiny_gpu", "vllm", "0.24.0", "Synthetic GPU", {k: f"{k}.csv" for k in out}, **out)


# ---- MLA module tables (tests/test_mla_tables.py): tiny_gpu, vLLM 0.20.0, in the package's layout with the
# checkpoints' config.json in model_configs/ (as aiconfigurator-core ships them beside systems/).

TINY_MLA = {  # a DeepSeek-V3-shaped config.json, tiny: 4 heads, so TP 1 reads num_heads 4 and TP 2 num_heads 2
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True, "kv_lora_rank": 32, "q_lora_rank": 64,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "vocab_size": 512,
    "max_position_embeddings": 4096, "rope_theta": 10000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
OTHER_MLA = dict(TINY_MLA, kv_lora_rank=64)  # measured too, never read for TINY_MLA (another shape)
MLA_MODELS = {"test-org/Tiny-MLA": 1.0, "test-org/Other-MLA": 3.0}  # checkpoint -> a factor on its times
MLA_HEADS = [4, 2]
MLA_CTX_BATCH, MLA_CTX_ISL = [1, 2, 4], [16, 64, 256]
MLA_GEN_BATCH, MLA_GEN_STEP = [1, 2, 4, 8], [2, 16, 256]
MLA_KV = {"bfloat16": (1.0, "FLASH_ATTN_MLA"), "fp8": (0.8, "FLASHMLA")}  # KV dtype -> (factor, decode kernel)


def mla_ctx_ms(batch, isl, heads, kv="bfloat16", model="test-org/Tiny-MLA"):
    return (0.02 + heads * (batch * isl * 1e-6 + batch * isl * isl * 1e-8)) * MLA_KV[kv][0] * MLA_MODELS[model]


def mla_gen_ms(batch, step, heads, kv="bfloat16", model="test-org/Tiny-MLA"):
    return (0.015 + heads * batch * step * 1e-6) * MLA_KV[kv][0] * MLA_MODELS[model]


def mla_frames() -> dict[str, pd.DataFrame]:
    """The two module tables: rows of each checkpoint, both KV dtypes, bf16 GEMMs only; the context
    table's short queries under the decode kernel and the rest under FLASH_ATTN, as vLLM runs them."""
    common = {"framework": "VLLM", "version": "0.20.0", "device": "Synthetic GPU", "architecture": "DeepseekV3ForCausalLM",
              "mla_dtype": "bfloat16", "gemm_type": "bfloat16", "tp_size": 1}
    ctx = pd.DataFrame([dict(common, op_name="mla_context_module", model=m, kv_cache_dtype=kv,
                             kernel_source=MLA_KV[kv][1] if s <= 16 else "FLASH_ATTN", num_heads=h, batch_size=b,
                             isl=s, step=0, latency=mla_ctx_ms(b, s, h, kv, m))
                        for m, kv, h, b, s in itertools.product(MLA_MODELS, MLA_KV, MLA_HEADS, MLA_CTX_BATCH, MLA_CTX_ISL)
                        if not (b == 4 and s == 256)])  # triangular, as the real tables
    gen = pd.DataFrame([dict(common, op_name="mla_generation_module", model=m, kv_cache_dtype=kv,
                             kernel_source=MLA_KV[kv][1], num_heads=h, batch_size=b, isl=1, step=s,
                             latency=mla_gen_ms(b, s, h, kv, m))
                        for m, kv, h, b, s in itertools.product(MLA_MODELS, MLA_KV, MLA_HEADS, MLA_GEN_BATCH, MLA_GEN_STEP)
                        if not (b == 8 and s == 256)])
    return {"mla_context_module_perf": ctx, "mla_generation_module_perf": gen}


def write_mla_layout(root) -> None:
    """The MLA tables and the checkpoints' config.json into a layout rooted at `root` (root/systems/data/...)."""
    import json

    folder = root / "systems" / "data" / "tiny_gpu" / "mla" / "vllm" / "0.20.0"
    folder.mkdir(parents=True, exist_ok=True)
    for table, frame in mla_frames().items():
        frame.to_csv(folder / f"{table}.csv", index=False)
    configs = root / "model_configs"
    configs.mkdir(exist_ok=True)
    for name, raw in (("test-org/Tiny-MLA", TINY_MLA), ("test-org/Other-MLA", OTHER_MLA)):
        (configs / f"{name.replace('/', '--')}_config.json").write_text(json.dumps(raw, indent=1) + "\n")
