"""Operator-table profiles: what `sim calibrate --from-ops` derives, stored as one JSON file.

    {"format": "servesim-profile", "version": 1, "kind": "operator-tables",
     "model": "Llama-3.1-8B", "model_config": {hidden_size, ...}, "hardware": "H100-SXM",
     "tp": 1, "dtype": "bf16", "kv_cache_dtype": "bf16", "created": "...",
     "source": {"system": "h100_sxm", "framework": "vllm", "framework_version": "0.24.0", "device": ...,
                "files": {...}, "origin": "..."},
     "step_overhead": {"seconds": 0.0, "source": "..."},
     "client_overhead": {"fixed_s": ..., "per_prompt_token_s": ..., "source": "..."},
     "operators": {"gemm": ..., "attention": ..., "allreduce": ..., "memory": ..., "notes": [...]}}

`operators` is backends/costmodel/optables/derive.py's output: the model's curves, not the raw tables. A loaded
profile builds the same `OperatorModel` as the tables did, so it gives the same step times.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from backends.costmodel.optables.derive import GEMM_OPS, derive
from backends.costmodel.optables.model import OperatorModel, StepOverhead
from backends.costmodel.optables.tables import TableSet
from sim.errors import ServesimError
from sim.files import atomic_write_text
from sim.jsonable import fields_of, read_json_file

PROFILE_FORMAT = "servesim-profile"
PROFILE_VERSION = 1
KIND = "operator-tables"
MODEL_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")
OPTIONAL_FIELDS = {"qk_norm": False}


def model_shape(model) -> dict:
    """The fields the operator model reads, from a ModelConfig or a preset's dict."""
    get = model.get if isinstance(model, dict) else (lambda k, d=None: getattr(model, k, d))
    missing = [k for k in MODEL_FIELDS if get(k) is None]
    if missing:
        raise ServesimError(f"the model lacks {', '.join(missing)}")
    shape = {k: int(get(k)) for k in MODEL_FIELDS}
    shape.update({k: bool(get(k, default)) for k, default in OPTIONAL_FIELDS.items()})
    return shape
ORIGIN = ("NVIDIA AIConfigurator operator tables (github.com/ai-dynamo/aiconfigurator, "
          "aic-core/src/aiconfigurator_core/systems/data), Apache License 2.0")
# vLLM 0.24 schedules asynchronously by default (SchedulerConfig.async_scheduling, vllm/config/
# scheduler.py; on by default since vllm-project/vllm#27614): the engine core prepares step
# k + 1 while the GPU runs step k, so its CPU work does not add to the step.
DEFAULT_STEP_OVERHEAD = StepOverhead(0.0, "vLLM >= 0.14 schedules asynchronously (vllm/config/scheduler.py, "
                                          "async_scheduling; vllm-project/vllm#27614): CPU work overlaps the GPU")


@dataclass(frozen=True)
class ClientOverhead:
    """What a benchmark client's TTFT adds to the engine's: vLLM's API server handles requests one
    at a time (one asyncio process) before the engine core sees them: a fixed part (HTTP,
    validation, handing the request over) and the prompt's tokenisation."""

    fixed_s: float = 1e-3  # a stated estimate
    per_prompt_token_s: float = 2e-6  # ~500k tokens/s on one core (source below)
    source: str = ("fixed: a stated 1 ms estimate; tokenisation: ~500k tokens/s on one CPU core, measured in "
                   "andyluo7.github.io/llm/amd/mi300x/vllm/lmcache/performance/2026/05/14/"
                   "cpu-gpu-codesign-agentic-inference-mi300x/")

    def __post_init__(self) -> None:
        if not (self.fixed_s >= 0 and self.per_prompt_token_s >= 0):
            raise ServesimError(f"client overheads must be >= 0, got {self.fixed_s} s and "
                                f"{self.per_prompt_token_s} s per prompt token")

    def seconds(self, num_prompt_tokens: int) -> float:
        return self.fixed_s + self.per_prompt_token_s * num_prompt_tokens


@dataclass(frozen=True)
class OpProfile:
    model: str
    model_config: dict
    hardware: str | None
    tp: int
    dtype: str
    kv_cache_dtype: str
    source: dict
    operators: dict
    step_overhead: StepOverhead = DEFAULT_STEP_OVERHEAD
    client_overhead: ClientOverhead = ClientOverhead()
    created: str = ""

    def op_model(self) -> OperatorModel:
        return OperatorModel(self.operators, self.model_config, self.tp, self.dtype, self.kv_cache_dtype,
                             self.step_overhead)

    def to_json(self) -> dict:
        co = self.client_overhead
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "kind": KIND, "model": self.model,
                "model_config": model_shape(self.model_config), "hardware": self.hardware,
                "tp": self.tp, "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype, "created": self.created,
                "source": self.source,
                "step_overhead": {"seconds": self.step_overhead.seconds, "source": self.step_overhead.source},
                "client_overhead": {"fixed_s": co.fixed_s, "per_prompt_token_s": co.per_prompt_token_s,
                                    "source": co.source},
                "operators": self.operators}


def build_profile(tables: TableSet, model_name: str, model, hardware: str | None = None, tp: int = 1,
                  dtype: str = "bf16", kv_cache_dtype: str = "bf16", nvlink_bytes_per_s: float | None = None,
                  pcie_bytes_per_s: float | None = None, step_overhead: StepOverhead = DEFAULT_STEP_OVERHEAD,
                  client_overhead: ClientOverhead = ClientOverhead(),
                  allreduce_fusion_max_bytes: float = 0.0, gpus_per_node: int | None = None,
                  inter_node_bytes_per_s: float | None = None) -> OpProfile:
    shape = model_shape(model)
    operators = derive(tables, shape, tp, dtype, kv_cache_dtype, nvlink_bytes_per_s, pcie_bytes_per_s,
                       allreduce_fusion_max_bytes, gpus_per_node, inter_node_bytes_per_s)
    source = dict(tables.source, origin=ORIGIN)
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return OpProfile(model_name, shape, hardware, tp, dtype, kv_cache_dtype, source, operators, step_overhead,
                     client_overhead, created)


def save_op_profile(profile: OpProfile, path: str | Path) -> None:
    """One key per line, the operator curves compact (a committed profile stays ~15 KB)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = profile.to_json()
    operators = data.pop("operators")
    head = json.dumps(data, indent=1)
    atomic_write_text(path, head[:-2] + ',\n "operators": ' + json.dumps(operators, separators=(",", ":")) + "\n}\n")


def is_op_profile(data: dict) -> bool:
    return isinstance(data, dict) and data.get("kind") == KIND


def op_profile_from_json(data: dict, path: str | Path) -> OpProfile:
    """An `OpProfile` from a profile's parsed JSON; `path` names it in errors."""
    if data.get("format") != PROFILE_FORMAT or data.get("version") != PROFILE_VERSION or not is_op_profile(data):
        raise ServesimError(f"{path}: not a servesim operator-table profile (format {PROFILE_FORMAT}, "
                            f"version {PROFILE_VERSION}, kind {KIND})")
    with fields_of(path):
        so, co = data["step_overhead"], data["client_overhead"]
        check_profile_numbers(data)
        profile = OpProfile(str(data["model"]), model_shape(data["model_config"]),
                            data.get("hardware"), int(data["tp"]), str(data["dtype"]), str(data["kv_cache_dtype"]),
                            dict(data["source"]), dict(data["operators"]),
                            StepOverhead(float(so["seconds"]), str(so["source"])),
                            ClientOverhead(float(co["fixed_s"]), float(co["per_prompt_token_s"]), str(co["source"])),
                            str(data.get("created", "")))
        profile.op_model()  # refuses curves that do not fit the model, TP or dtype
    return profile


MAX_OPERATOR_S = 1e3  # one operator's seconds (a layer's GEMM, attention, an all-reduce, a kernel's floor): far less


def check_profile_numbers(data: dict) -> None:
    """The numbers of an operator-table profile's file, checked before they price anything: its model's
    shape and TP whole numbers of at least 1, each derived curve's sizes increasing and its seconds positive
    and finite, one per size (a grid's, one per pair of sizes), the memory bandwidth and all-reduce figures
    positive. A profile edited by hand or cut short was an internal error (OverflowError, ZeroDivisionError,
    IndexError, AttributeError) or priced steps from NaN and negative seconds. Each second figure is at most
    MAX_OPERATOR_S and each bandwidth at least a byte a second (1e308 s, or a bandwidth of 1e-300, priced a
    step to infinity: an internal error), and no number is past int64 (numpy made a curve of Python
    objects). Raises naming the field."""
    def fail(where: str, value, expected: str):
        text = repr(value)
        raise ServesimError(f"{where} = {text if len(text) <= 60 else text[:57] + '...'}, expected {expected}")

    def obj(value, where: str) -> dict:
        if not isinstance(value, dict):
            fail(where, value, "an object")
        return value

    def number(value, where: str, least: float = 0.0, whole: bool = False, zero: bool = False,
               most: float | None = None) -> float:
        # (a whole number past int64 makes numpy's array of a curve one of Python objects: a TypeError in a lookup)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 2.0**63 \
            and math.isfinite(value) and (value > least or (zero and value == least)) \
            and (not whole or float(value).is_integer()) and (most is None or value <= most)
        if not ok:
            fail(where, value, f"a {'whole' if whole else 'finite'} number "
                               f"{'at least' if zero else 'above'} {least:g}"
                               + ("" if most is None else f" and at most {most:g}"))
        return value

    def axis(value, where: str) -> int:
        if not isinstance(value, list) or not value:
            fail(where, value, "a list of sizes")
        for i, v in enumerate(value):
            number(v, f"{where}[{i}]")
        if any(b <= a for a, b in zip(value, value[1:])):
            fail(where, value, "sizes in increasing order")
        return len(value)

    def seconds(value, where: str, n: int) -> None:
        if not isinstance(value, list) or len(value) != n:
            fail(where, value, f"a list of {n} times (one per size)")
        for i, v in enumerate(value):
            number(v, f"{where}[{i}]", most=MAX_OPERATOR_S)

    def curve(value, where: str, x: str) -> dict:
        c = obj(value, where)
        seconds(c.get("seconds"), f"{where}.seconds", axis(c.get(x), f"{where}.{x}"))
        return c

    shape = obj(data["model_config"], "model_config")
    for field in MODEL_FIELDS:
        number(shape.get(field), f"model_config.{field}", least=1, whole=True, zero=True)
    number(data["tp"], "tp", least=1, whole=True, zero=True)
    ops = obj(data["operators"], "operators")
    gemm = obj(ops.get("gemm"), "operators.gemm")
    for op in (*GEMM_OPS, "lm_head"):
        if op not in gemm:
            fail(f"operators.gemm.{op}", None, "the GEMM's curve")
    for op, c in gemm.items():
        curve(c, f"operators.gemm.{op}", "m")
    number(gemm["lm_head"].get("n"), "operators.gemm.lm_head.n", least=1, whole=True, zero=True)
    attention = obj(ops.get("attention"), "operators.attention")
    for phase, b in (("context", "isl"), ("generation", "kv_len")):
        g = obj(attention.get(phase), f"operators.attention.{phase}")
        where = f"operators.attention.{phase}"
        rows, cols = axis(g.get("batch"), f"{where}.batch"), axis(g.get(b), f"{where}.{b}")
        grid = g.get("seconds")
        if not isinstance(grid, list) or len(grid) != rows:
            fail(f"{where}.seconds", grid, f"{rows} rows (one per batch size)")
        for i, row in enumerate(grid):
            seconds(row, f"{where}.seconds[{i}]", cols)
    ar = ops.get("allreduce")
    if ar is not None:
        obj(ar, "operators.allreduce")
        number(ar.get("num_gpus"), "operators.allreduce.num_gpus", least=2, whole=True, zero=True)
        for mode in ("graph", "eager", "nccl", "fused"):
            if mode in ar:
                curve(ar[mode], f"operators.allreduce.{mode}", "message_bytes")
        if "fused" in ar:
            number(ar["fused"].get("max_bytes"), "operators.allreduce.fused.max_bytes")
        if "graph" in ar or "eager" in ar:
            number(ar.get("table_max_bytes"), "operators.allreduce.table_max_bytes")
        number(ar.get("ring_latency_s", 0.0), "operators.allreduce.ring_latency_s", zero=True, most=MAX_OPERATOR_S)
        key = "link_bytes_per_s" if "link_bytes_per_s" in ar else "nvlink_bytes_per_s"
        number(ar.get(key), f"operators.allreduce.{key}", least=1, zero=True)
    memory = obj(ops.get("memory"), "operators.memory")
    number(memory.get("bandwidth_bytes_per_s"), "operators.memory.bandwidth_bytes_per_s", least=1, zero=True)
    number(memory.get("kernel_floor_s"), "operators.memory.kernel_floor_s", zero=True, most=MAX_OPERATOR_S)
    for name in ("fixed_s", "per_prompt_token_s"):
        number(obj(data["client_overhead"], "client_overhead").get(name), f"client_overhead.{name}", zero=True,
               most=MAX_OPERATOR_S)


def load_op_profile(path: str | Path) -> OpProfile:
    path = Path(path)
    return op_profile_from_json(read_json_file(path, "profile", "make one with `sim calibrate --from-ops`"), path)
