"""How well a fused-MoE kernel's measured curve carries to another model's shape, measured on the
tables alone (no deployment rows): leave one shape out.

For every kernel of a system's vLLM 0.24 moe_perf table measured at two or more shapes (hidden,
intermediate, top-k, experts) under the same expert dtype, MoE TP, EP and token distribution, each
shape's curve is predicted from the others with `transferred_moe_curve` (the carry `--moe-kernel`
uses where no version measures the named kernel at a model's shape: backends/costmodel/optables/moe.py)
and compared with its measured times at every token count. Two carries are compared: the kernel's
floor plus its work scaled by the rooflines (what servesim does), and the work's efficiency applied
to the whole time (floor 0). Errors per token range: decode (1-64 tokens), middle (65-1023),
prefill (1024 and up).

    PYTHONPATH=$PWD .venv/bin/python scripts/moe_carry_loo.py [--systems h100_sxm,h200_sxm,b200_sxm]

`--layouts`: the carry of a shape or layout no version measures in the dtype (`pick_moe_curve`'s last
pass, `transferred_moe_curve(any_layout=True)`). Every (shape, MoE TP, EP) of each dtype and token
distribution is predicted with vLLM's kernel for it (`moe_kernel`), first with only that layout left out
(its other layouts stay: Qwen3-30B-A3B at MoE TP 8 from its TP 4 rows), then with the model's shape left
out at every layout (a model the tables never measured), against the datasheet roofline of the layer
(`moe_layer_roofline`, what servesim priced such a layer with before). About 2.5 minutes a system.
"""

from __future__ import annotations

import argparse

import numpy as np

from backends.costmodel.optables.moe import HELPER_KERNELS, MoEShape, moe_kernel, moe_layer_roofline, transferred_moe_curve
from backends.costmodel.optables.systems import LayoutTable, read_layout_table, require_package
from backends.hardware import resolve_hardware

KEYS = ["kernel_source", "moe_dtype", "moe_tp_size", "moe_ep_size", "distribution"]
SHAPE = ["hidden_size", "inter_size", "topk", "num_experts"]
RANGES = {"decode 1-64": (1, 64), "middle 65-1023": (65, 1023), "prefill >= 1024": (1024, 1 << 30)}


def loo_errors(system: str, version: str = "0.24.0") -> dict[str, dict[str, list[float]]]:
    """Signed relative errors (predicted / measured - 1) per carry and token range."""
    data = require_package() / "data"
    table = read_layout_table(data, system, "moe", "vllm", "moe_perf", version)
    hardware = resolve_hardware(system)
    frame = table.frame
    shape_of = frame[SHAPE].apply(tuple, axis=1)
    out: dict[str, dict[str, list[float]]] = {c: {r: [] for r in RANGES} for c in ("floor + work", "proportional")}
    for key, group in frame.groupby(KEYS):
        kernel, dtype, tp, ep, distribution = key
        shapes = group.groupby(SHAPE)
        if shapes.ngroups < 2:
            continue
        for shape_key, rows in shapes:
            curve = rows.groupby("num_tokens")["seconds"].mean().sort_index()
            if curve.index[0] > 1:
                continue
            others = frame[(frame["kernel_source"] != kernel) | (shape_of != shape_key)]
            left = LayoutTable(table.table, table.version, table.how, table.paths, others)
            shape = MoEShape(*(int(v) for v in shape_key), int(tp), int(ep), str(dtype), str(distribution))
            for carry, floor in (("floor + work", None), ("proportional", 0.0)):
                found = transferred_moe_curve([left], shape, str(kernel), hardware, floor_s=floor)
                if found is None:
                    continue
                _, _, (_, xs, ys) = found
                measured = curve.reindex(xs).to_numpy()
                for name, (low, high) in RANGES.items():
                    inside = (xs >= low) & (xs <= high) & np.isfinite(measured)
                    out[carry][name] += (ys[inside] / measured[inside] - 1).tolist()
    return out


LAYOUT = [*SHAPE, "moe_tp_size", "moe_ep_size"]


def layout_errors(system: str, leave_out: str, version: str = "0.24.0") -> dict[str, dict[str, list[float]]]:
    """Signed relative errors of the layout carry and of the roofline, per token range. `leave_out`:
    "layout" (this shape at this MoE TP and EP) or "model" (this shape at every layout)."""
    data = require_package() / "data"
    table = read_layout_table(data, system, "moe", "vllm", "moe_perf", version)
    hardware = resolve_hardware(system)
    frame = table.frame
    key_of = frame[LAYOUT].apply(tuple, axis=1)
    shape_of = frame[SHAPE].apply(tuple, axis=1)
    out: dict[str, dict[str, list[float]]] = {c: {r: [] for r in RANGES} for c in ("carry", "roofline")}
    for (dtype, distribution), group in frame.groupby(["moe_dtype", "distribution"]):
        for key, rows in group.groupby(LAYOUT):
            shape = MoEShape(*(int(v) for v in key), str(dtype), str(distribution))
            kernels = [str(k) for k in rows["kernel_source"].value_counts().index if str(k) not in HELPER_KERNELS]
            if not kernels:
                continue
            kernel = moe_kernel(kernels, str(dtype), shape.moe_ep_size)
            curve = rows[rows["kernel_source"] == kernel].groupby("num_tokens")["seconds"].mean().sort_index()
            if curve.index[0] > 1:
                continue
            gone = (key_of == key) if leave_out == "layout" else (shape_of == key[:4])
            others = frame[~(gone & (frame["moe_dtype"] == dtype))]
            left = LayoutTable(table.table, table.version, table.how, table.paths, others)
            found = transferred_moe_curve([left], shape, None, hardware, any_layout=True)
            if found is None:
                continue
            _, _, (_, xs, ys) = found
            measured = curve.reindex(xs).to_numpy()
            roofline = moe_layer_roofline(hardware, shape, xs)
            for name, (low, high) in RANGES.items():
                inside = (xs >= low) & (xs <= high) & np.isfinite(measured)
                out["carry"][name] += (ys[inside] / measured[inside] - 1).tolist()
                out["roofline"][name] += (roofline[inside] / measured[inside] - 1).tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="h100_sxm,h200_sxm,b200_sxm")
    parser.add_argument("--layouts", action="store_true", help="the carry of an unmeasured layout or shape")
    args = parser.parse_args()
    print("| system | carry | tokens | points | median APE | p90 APE | median signed |")
    print("|---|---|---|---|---|---|---|")
    for system in args.systems.split(","):
        found = {"": loo_errors(system)} if not args.layouts else {
            f"{out} left out, ": layout_errors(system, out) for out in ("layout", "model")}
        results = {f"{prefix}{carry}": ranges for prefix, per in found.items() for carry, ranges in per.items()}
        for carry, ranges in results.items():
            for name, errors in ranges.items():
                if not errors:
                    continue
                e = np.array(errors) * 100
                print(f"| {system} | {carry} | {name} | {len(e)} | {np.median(np.abs(e)):.1f}% | "
                      f"{np.percentile(np.abs(e), 90):.1f}% | {np.median(e):+.1f}% |")


if __name__ == "__main__":
    main()
