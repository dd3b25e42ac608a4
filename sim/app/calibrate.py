"""`sim calibrate`: measure a grid of batch shapes on the real backend and fit a cost-model profile
(the measuring and fitting are backends/calibration.py)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from backends.calibration import GRIDS, calibrate, default_grid, format_profile, grid_num_blocks
from backends.presets import get_model
from backends.profile import save_profile
from sim.app.outputs import atomic_path, check_file_destination, command_inputs
from sim.app.progress import Progress
from sim.errors import ServesimError

CLOCKS = ("wall", "thread")


def real_backend(model: str, device: str, block_size: int, num_blocks: int | None, seed: int,
                 weights: str | None):
    try:
        from backends.real import RealBackend
    except ImportError as e:
        raise ServesimError(f"the real backend cannot load ({e}); install it with `pip install -e .[real]`") from None
    return RealBackend(model, device=device, block_size=block_size, num_blocks=num_blocks, seed=seed, weights=weights)


# Each way of calibrating has flags of its own, with these defaults; a flag of the other way, given a
# value other than its default, is refused rather than ignored (a --tp 2 that fits a TP 1 profile).
REAL_ONLY = {"device": "cpu", "grid": None, "warmup": 2, "repeats": 5, "block_size": 16, "num_blocks": None,
             "weights": None, "seed": 0, "clock": "wall"}
FROM_OPS_ONLY = {"system": None, "framework": "vllm", "hardware": None, "tp": 1, "dtype": "bf16",
                 "kv_cache_dtype": "auto"}


def check_applies(args: argparse.Namespace) -> None:
    from_ops = args.from_ops is not None
    for name, default in (REAL_ONLY if from_ops else FROM_OPS_ONLY).items():
        value = getattr(args, name)
        if value != default:
            flag = "--" + name.replace("_", "-")
            raise ServesimError(f"{flag} {value} does not apply to sim calibrate with --from-ops, which runs no "
                                "backend and derives the profile from the tables" if from_ops else
                                f"{flag} {value} applies with --from-ops (a profile derived from operator tables); "
                                "the real backend's calibration measures one device (--device) as it is")


def cmd_calibrate(args: argparse.Namespace) -> int:
    check_applies(args)
    if args.from_ops is not None:
        from sim.app.opprofiles import cmd_from_ops

        return cmd_from_ops(args)
    out = Path(args.out)
    if out.suffix != ".json":
        raise ServesimError(f"--out {out}: a profile is a .json file")
    csv = out.with_suffix(".csv")
    for path in (out, csv):  # checked before the measuring, which takes minutes; never over an input
        check_file_destination(path, command_inputs(args), overwrite=args.overwrite,
                               other="another --out (profiles/tiny-cpu.json is the bundled profile the tests use)")
    get_model(args.model)
    grid = args.grid or default_grid(args.device)
    num_blocks = args.num_blocks
    if num_blocks is None and not args.device.startswith("cuda"):
        num_blocks = grid_num_blocks(args.model, grid, args.block_size)
    backend = real_backend(args.model, args.device, args.block_size, num_blocks, args.seed, args.weights)
    from backends.real.timing import with_clock

    started = time.perf_counter()
    bar = Progress(0, "runs", sys.stderr.isatty() and not args.quiet, label=f"calibrating {args.model} on {args.device}")
    profile, raw = calibrate(with_clock(backend, args.clock), args.model, grid, args.warmup, args.repeats, args.seed,
                             progress=bar)
    bar.close()
    profile = replace(profile, grid={**profile.grid, "clock": args.clock})
    with atomic_path(out) as temp:
        save_profile(profile, temp)
    with atomic_path(csv) as temp:
        raw.to_csv(temp, index=False)
    if not args.quiet:
        print(format_profile(profile))
        print(f"measured {len(raw)} steps in {time.perf_counter() - started:.1f} s; wrote {out} and {csv}")
    return 0


def register(subparsers) -> None:
    from sim.config import BLOCK_SIZE, NUM_BLOCKS, REPEATS, SEED, TENSOR_PARALLEL, WARMUP_RUNS

    p = subparsers.add_parser(
        "calibrate", help="fit a cost-model profile on the real backend, or derive one from operator tables",
        description="Run a grid of batch shapes (decode, prefill chunks, mixed) on the real backend, keep the "
                    "median of the repeats, fit the cost model's coefficients and write a profile (JSON) and "
                    "the raw measurements (CSV beside it). With --from-ops DIR, derive the profile instead from "
                    "a folder of AIConfigurator operator tables measured on a GPU (no backend runs). Use the "
                    "profile with `sim replay/sweep/capacity/bench --profile`.")
    p.add_argument("--model", required=True, help="model preset (see `sim models`); with --from-ops also a "
                                                  "Hugging Face config.json or a folder holding one")
    p.add_argument("--from-ops", default=None, metavar="DIR",
                   help="derive the profile from operator tables in DIR (<system>__<framework>-<version>__"
                        "{gemm,context_attention,generation_attention,custom_allreduce}_perf.parquet or .csv)")
    p.add_argument("--system", default=None, help="with --from-ops: the tables' system, e.g. h100_sxm")
    p.add_argument("--framework", default=FROM_OPS_ONLY["framework"], help="with --from-ops: the tables' framework (default: vllm)")
    p.add_argument("--hardware", default=None, metavar="NAME|FILE.json",
                   help="with --from-ops: the GPU the tables were measured on (its NVLink bandwidth prices "
                        "large all-reduces; needed for --tp > 1)")
    p.add_argument("--tp", type=TENSOR_PARALLEL.flag_type("--tp"), default=FROM_OPS_ONLY["tp"], metavar="N",
                   help="with --from-ops: tensor parallelism (default: 1)")
    p.add_argument("--dtype", default=FROM_OPS_ONLY["dtype"], choices=("bf16", "fp8"), help="with --from-ops: weights (default: bf16)")
    p.add_argument("--kv-cache-dtype", default=FROM_OPS_ONLY["kv_cache_dtype"], choices=("auto", "fp8"),
                   help="with --from-ops: KV cache (default: auto, bf16)")
    p.add_argument("--device", default=REAL_ONLY["device"], choices=("cpu", "cuda"), help="the real backend's device (default: cpu)")
    p.add_argument("--out", required=True, help="profile to write, e.g. profiles/my-cpu.json (and its raw "
                                                "measurements beside it, my-cpu.csv)")
    p.add_argument("--overwrite", action="store_true", help="replace --out (and its .csv) if they exist")
    p.add_argument("--grid", default=None, choices=list(GRIDS),
                   help="grid of shapes (default: cpu on a CPU, full on a GPU; small for a quick look)")
    p.add_argument("--warmup", type=WARMUP_RUNS.flag_type("--warmup"), default=REAL_ONLY["warmup"], metavar="N",
                   help="unmeasured runs per shape (default: 2)")
    p.add_argument("--repeats", type=REPEATS.flag_type("--repeats"), default=REAL_ONLY["repeats"], metavar="N",
                   help="measured runs per shape; the median is fitted (default: 5)")
    p.add_argument("--block-size", type=BLOCK_SIZE.flag_type("--block-size"), default=REAL_ONLY["block_size"], metavar="N",
                   help="tokens per KV block (default: 16)")
    p.add_argument("--num-blocks", type=NUM_BLOCKS.flag_type("--num-blocks"), default=None, metavar="N",
                   help="KV blocks to allocate (default: on a CPU, what the largest shape needs; on a GPU, "
                        "derived from its memory); shapes that need more are skipped")
    p.add_argument("--weights", default=None, help="local safetensors weights (default: random, seeded)")
    p.add_argument("--seed", type=SEED.flag_type("--seed"), default=REAL_ONLY["seed"],
                   help="seed of weights, token ids and block ids (default: 0)")
    p.add_argument("--clock", default=REAL_ONLY["clock"], choices=CLOCKS,
                   help="wall: the backend's own timing (default); thread: the CPU time of the calling thread, "
                        "for a CPU shared with other processes (--device cpu only)")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=cmd_calibrate)
