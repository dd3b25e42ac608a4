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
