"""Derive the committed operator-table profiles (profiles/ops/) from the shared AIConfigurator tables.

One profile per preset model, GPU (H100-SXM from h100_sxm tables, H200 from h200_sxm), weight dtype
(bf16, fp8), TP degree (1, 2, 4, 8) and KV cache dtype (bf16, and fp8: the tables measure both
attention kernels), where the model's weights fit the GPUs
(vLLM's KV plan, backends/kv_capacity.py, at its defaults) and the tables price the shapes. Each
is what `sim calibrate --from-ops DIR --system S --model M --hardware H --tp N --dtype D` writes.

    PYTHONPATH=$PWD python scripts/make_op_profiles.py [--ops ../shared/gpu-data/aiconfigurator]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from backends.costmodel.optables.profile import build_profile, save_op_profile
from backends.costmodel.optables.tables import load_tables
from backends.hardware import resolve_hardware
from backends.kv_capacity import kv_capacity
from backends.model_config import resolve_model
from backends.presets import MODELS
from sim.app.opprofiles import OPS_DIR, kv_name, profile_file_name
from sim.errors import ServesimError

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "gpu-data" / "aiconfigurator"
SYSTEMS = {"H100-SXM": "h100_sxm", "H200": "h200_sxm"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=str(DATA))
    ap.add_argument("--out", default=str(OPS_DIR))
    args = ap.parse_args()
    written = []
    for hardware_name, system in SYSTEMS.items():
        tables = load_tables(args.ops, system)
        hardware = resolve_hardware(hardware_name)
        for name in MODELS:
            if name == "tiny":
                continue
            model = resolve_model(name)
            for dtype, tp, kv in ((d, t, k) for d in ("bf16", "fp8") for t in (1, 2, 4, 8) for k in ("auto", "fp8")):
                try:
                    model.check_tp(tp)
                    kv_capacity(model, hardware, block_size=16, gpu_memory_utilization=0.9,
                                max_num_batched_tokens=8192, max_num_seqs=1024, tp=tp, dtype=dtype,
                                kv_cache_dtype=kv, max_model_len=8192)
                    profile = build_profile(tables, name, model, hardware_name, tp, dtype, kv_name(kv),
                                            nvlink_bytes_per_s=hardware.nvlink_bandwidth,
                                            pcie_bytes_per_s=hardware.pcie_bandwidth)
                except ServesimError as e:
                    print(f"skip {hardware_name} {name} TP {tp} {dtype} KV {kv}: {e}")
                    continue
                path = Path(args.out) / profile_file_name(hardware_name, name, tp, dtype, kv)
                save_op_profile(profile, path)
                written.append(path)
    print(f"wrote {len(written)} profiles to {args.out}")


if __name__ == "__main__":
    main()
