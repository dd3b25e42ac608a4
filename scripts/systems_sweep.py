"""Every system the tables package describes, every model family, five layouts: does each run?

A robustness check, not an accuracy one: it writes deployments in AIConfigurator's silicon format
(the package's own columns) for 13 systems x 10 models and precisions x TP 1, 2, 8 and two
data-parallel, expert-parallel layouts of the MoE models (546 rows, ISL 1024, OSL 64, 4 clients;
the "measured" TTFT and TPOT are placeholders), runs `sim validate` on them with two prompts per
client, and prints how many ran and why the others were skipped, grouped by reason. Every row must
either run or be skipped with a reason a user can act on (no tables for the system, weights that do
not fit, a dtype the GPU's tables never measure); an internal error is a bug. It also lists the rows
whose MoE layer fell back to the roofline. About a minute on 2 cores.

    PYTHONPATH=$PWD .venv/bin/python scripts/systems_sweep.py [--out runs/systems-sweep]
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
from pathlib import Path

from backends.costmodel.optables.systems import require_package
from sim.app.validate import Protocol, validate

SYSTEMS = ["a100_sxm", "l40s", "rtx_pro_6000_server", "gb200", "gb300", "b300_sxm", "b60", "h100_sxm", "h200_sxm",
           "b200_sxm", "a100_pcie", "h100_pcie", "l4"]
MODELS = [("meta-llama/Meta-Llama-3.1-8B", "bf16"), ("meta-llama/Meta-Llama-3.1-8B", "fp8"), ("Qwen/Qwen3-32B", "bf16"),
          ("Qwen/Qwen3-30B-A3B", "bf16"), ("Qwen/Qwen3-30B-A3B-FP8", "fp8"), ("openai/gpt-oss-120b", "fp4"),
          ("mistralai/Mixtral-8x7B-v0.1", "bf16"), ("deepseek-ai/DeepSeek-V3", "fp8"),
          ("Qwen/Qwen3-235B-A22B-FP8", "fp8"), ("meta-llama/Meta-Llama-3.1-70B", "fp4")]
LAYOUTS = [(1, 1, 1), (2, 1, 1), (8, 1, 1), (1, 2, 2), (2, 4, 8)]  # (TP, attention DP, EP)
MOE = ("A3B", "gpt-oss", "Mixtral", "DeepSeek", "A22B")


def write_rows(path: Path) -> int:
    columns = next(csv.reader((require_package().parent / "systems" / "silicon_sample.csv").open()))
    rows = []
    for system in SYSTEMS:
        for model, precision in MODELS:
            moe = any(k in model for k in MOE)
            for tp, dp, ep in LAYOUTS:
                if dp > 1 and not moe:
                    continue
                row = dict.fromkeys(columns, "")
                row.update(id=f"sweep{len(rows)}_{system}_{model.split('/')[1]}_{precision}_tp{tp}_dp{dp}_ep{ep}",
                           silicon_data_source="systems_sweep.py; silicon_concurrency=4", backend="vllm",
                           backend_version="0.12.0" if len(rows) % 3 == 0 else "", model_path=model, system=system,
                           precision=precision, mode="agg", isl=1024, osl=64, batch_size=4, tp_size=tp, pp_size=1,
                           attention_dp_size=dp, moe_tp_size=tp * dp // ep if moe else 0, moe_ep_size=ep if moe else 0,
                           silicon_ttft_ms=100, silicon_tpot_ms=10)
                rows.append(row)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def kind(reason: str) -> str:
    """A skip reason without its numbers, paths and model names: one line per kind of reason."""
    if "do not fit" in reason:
        return "the weights do not fit on the GPUs"
    reason = re.sub(r"/\S+/", "", reason)  # a table's folder: its file name is enough
    return re.sub(r"\d+(\.\d+)*", "N", reason)[:150]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/systems-sweep")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = write_rows(out / "rows.csv")
    validate(out / "rows.csv", None, out / "validate", protocol=Protocol(prompts_per_client=2))
    result = json.loads((out / "validate" / "validate.json").read_text())
    reasons = collections.Counter(kind(s["reason"]) for s in result["skipped"])
    print(f"{n} rows: {result['all']['rows']} ran, {len(result['skipped'])} skipped")
    for reason, count in reasons.most_common():
        print(f"  {count:4d}  {reason}")
    with (out / "validate" / "validate.csv").open() as f:
        roofline = [r["id"] for r in csv.DictReader(f) if "moe: roofline" in r["tables"]]
    by_system = collections.Counter(next(s for s in SYSTEMS if f"_{s}_" in i) for i in roofline)
    print(f"{len(roofline)} rows priced their MoE layer with the roofline (an expert dtype the system's tables "
          f"never measure), by system: {dict(by_system)}")


if __name__ == "__main__":
    main()
