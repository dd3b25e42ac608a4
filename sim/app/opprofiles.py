"""Which cost model a run uses: `--profile roofline`, a profile file, or the committed operator-table
profile that matches the run; and `sim calibrate --from-ops`, which writes such profiles.

Committed operator-table profiles live in profiles/ops/, one per (hardware, model, TP, dtype, KV
dtype), named `<hardware>__<model>__tp<N>__<dtype>__kv-<kv dtype>.json`. A run without --profile
whose model (by its shapes), hardware, --tp, --dtype and --kv-cache-dtype match one of them uses
it, and summary.json names it (options.profile); `--profile roofline` forces the datasheet roofline.

A run on a system of AIConfigurator's package (`--hardware l40s`, ...; the `tables` extra), or any
run given `--vllm-version`, derives its profile from that system's vLLM tables when no committed
profile matches (`system_profile`), once: the profile is cached under $SERVESIM_CACHE (default
~/.cache/servesim/ops/), keyed by the package's version, the system, the vLLM version asked for,
the model's shapes, TP and dtypes.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

from backends.costmodel.optables.profile import OpProfile, is_op_profile, model_shape, op_profile_from_json
from sim.errors import ServesimError
from sim.jsonable import DuplicateKeyError, loads_unique

ROOFLINE = "roofline"
OPS_DIR = Path(__file__).resolve().parents[2] / "profiles" / "ops"


def kv_name(kv_cache_dtype: str) -> str:
    """The KV dtype a profile names: the run's `auto` is bf16."""
    return "bf16" if kv_cache_dtype == "auto" else kv_cache_dtype


def profile_file_name(hardware: str, model: str, tp: int, dtype: str, kv_cache_dtype: str) -> str:
    return f"{hardware}__{model}__tp{tp}__{dtype}__kv-{kv_name(kv_cache_dtype)}.json"


def read_profile_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        return loads_unique(path.read_text())  # a key given twice refused, as every servesim JSON file's reader does
    except DuplicateKeyError as e:
        raise ServesimError(f"{path}: {e}") from None
    except FileNotFoundError:
        raise ServesimError(f"{path}: no such profile (make one with `sim calibrate`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ServesimError(f"{path}: cannot read the profile: {e}") from None


# The hardware preset of each system whose operator tables servesim reads (AIConfigurator's names).
SYSTEM_HARDWARE = {"h100_sxm": "H100-SXM", "h200_sxm": "H200", "a100_sxm": "A100-80GB"}


def check_matches(profile: OpProfile, path, model, hardware, tp: int, dtype: str, kv_cache_dtype: str) -> None:
    """Refuse an operator-table profile derived for another model shape, GPU, TP degree or dtype."""
    wanted = {"tp": tp, "dtype": dtype, "kv_cache_dtype": kv_name(kv_cache_dtype)}
    for field, value in wanted.items():
        if getattr(profile, field) != value:
            raise ServesimError(f"{path} was derived for {field} {getattr(profile, field)}, not {value}; derive one "
                                f"with `sim calibrate --from-ops ... --{field.replace('_', '-')} {value}`")
    if profile.model_config != model_shape(model):
        raise ServesimError(f"{path} was derived for model {profile.model}, whose shapes differ from {model.name}'s")
    if profile.hardware is not None and profile.hardware != hardware.name:
        raise ServesimError(f"{path} was derived from {profile.source.get('system')} tables for {profile.hardware}, "
                            f"not {hardware.name}")
    # Derived without --hardware: its kernel times are still its system's GPU's (issue 32).
    system = profile.source.get("system")
    if profile.hardware is None and SYSTEM_HARDWARE.get(system) != hardware.name:
        measured_on = SYSTEM_HARDWARE.get(system, f"the GPU of system {system!r}")
        raise ServesimError(f"{path} holds kernel times measured on {measured_on} ({system} tables), not "
                            f"{hardware.name}: derive a profile from {hardware.name}'s tables, or run with "
                            f"--hardware {measured_on}" if system in SYSTEM_HARDWARE else
                            f"{path} holds kernel times of {system!r} tables, a system servesim does not map "
                            f"to --hardware {hardware.name}: derive it again with --hardware")


def matching_profile(model, hardware, tp: int, dtype: str, kv_cache_dtype: str,
                     folder: Path = OPS_DIR) -> tuple[OpProfile, Path] | None:
    """The committed operator-table profile for this deployment, if there is one."""
    # The names but the model's are taken as they are: a hardware file named H*.json (or [H]100-SXM.json)
    # matched the H100-SXM's profiles and replayed at the H100's step times whatever its own figures.
    pattern = profile_file_name(glob.escape(hardware.name), "*", tp, dtype, kv_cache_dtype)
    for path in sorted(folder.glob(pattern)):
        data = read_profile_json(path)
        if is_op_profile(data) and {k: data["model_config"].get(k) for k in model_shape(model)} == model_shape(model):
            return op_profile_from_json(data, path), path
    return None


# Today's named hardware and the package's system whose tables measured the same GPU.
PRESET_SYSTEMS = {"H100-SXM": "h100_sxm", "H200": "h200_sxm", "A100-80GB": "a100_sxm"}


def cache_dir() -> Path:
    return Path(os.environ.get("SERVESIM_CACHE") or Path.home() / ".cache" / "servesim") / "ops"


def system_of(hardware) -> str | None:
    """The package system whose tables price this hardware: its own, or a named preset's."""
    return hardware.system or PRESET_SYSTEMS.get(hardware.name)


def system_has_tables(system: str) -> bool:
    from backends.costmodel.optables.systems import has_tables

    return has_tables(system)


def system_profile(model, hardware, tp: int, dtype: str, kv_cache_dtype: str,
                   vllm_version: str | None = None, allreduce_fusion_max_mb: float = 0.0) -> tuple[OpProfile, Path]:
    """The operator-table profile of this deployment derived from the package's tables of the
    hardware's system (each table at `vllm_version` or the nearest the system has; None: the
    newest; FlashInfer's all-reduce fusion up to `allreduce_fusion_max_mb`, 0: off), from the
    cache where it was derived before."""
    from backends.costmodel.optables.profile import build_profile, load_op_profile, save_op_profile
    from backends.costmodel.optables.systems import INSTALL_HINT, package_systems_dir, package_version, require_package
    from backends.costmodel.optables.tables import load_layout

    system = system_of(hardware)
    if system is None:
        asked = " and ".join(flag for flag, given in (("--vllm-version", vllm_version is not None),
                                                      ("--allreduce-fusion-max-mb", bool(allreduce_fusion_max_mb)))
                             if given) or "this run"
        raise ServesimError(f"{asked} prices from the tables of a system of AIConfigurator's package; hardware "
                            f"{hardware.name} is none (see `sim hardware`)")
    if package_systems_dir() is None:
        raise ServesimError(f"the tables of {system} need the tables extra: {INSTALL_HINT}")
    shape = model_shape(model)
    import hashlib  # (here: only a derived profile's cache needs it)

    from backends.costmodel.optables.moe import cache_name, deriving_code_digest

    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    # The deriving code's digest too: a profile cached by other code (before a change to how the
    # tables are read) is never read.
    path = (cache_dir() / package_version() / f"code-{deriving_code_digest()[:12]}" / system
            / f"vllm-{vllm_version or 'newest'}"
            / f"{cache_name(model.name)}-{digest}__tp{tp}__{dtype}__kv-{kv_name(kv_cache_dtype)}"
            f"{f'__fused-allreduce-{allreduce_fusion_max_mb:g}mb' if allreduce_fusion_max_mb else ''}.json")
    if path.is_file():
        try:
            return load_op_profile(path), path
        except ServesimError:
            pass  # a cache file from another servesim: derive it afresh
    tables = load_layout(require_package() / "data", system, "vllm", vllm_version)
    profile = build_profile(tables, model.name, model, hardware.name, tp, dtype, kv_name(kv_cache_dtype),
                            nvlink_bytes_per_s=hardware.nvlink_bandwidth, pcie_bytes_per_s=hardware.pcie_bandwidth,
                            allreduce_fusion_max_bytes=allreduce_fusion_max_mb * 2**20,
                            gpus_per_node=hardware.gpus_per_node, inter_node_bytes_per_s=hardware.inter_node_bandwidth)
    try:
        save_op_profile(profile, path)  # under a temporary name, then renamed: another run may read it at once
    except OSError as e:  # a cache that cannot be written is left out, as the MoE cache is: the run goes on
        print(f"sim: warning: cannot cache the derived profile in {path.parent} ({e.strerror or e}); it is derived "
              "afresh on every run: set SERVESIM_CACHE to a folder servesim may write", file=sys.stderr)
    return profile, path


def tables_note(profile: OpProfile) -> str:
    """One line: the system and the vLLM version each table kind was read from."""
    src = profile.source
    versions = src.get("table_versions") or {}
    asked = src.get("asked_version")
    parts = ", ".join(f"{kind} {v}" + (" (the nearest)" if asked and v != asked else "")
                      for kind, v in versions.items()) or src.get("framework_version", "?")
    head = f"{src.get('system')} vLLM tables ({asked if asked else 'newest'} asked)"
    return f"{head}: {parts}"


def tables_summary(profile: OpProfile, hardware) -> dict:
    """summary.json's `operator_tables`: the system, the vLLM version asked for and each table's,
    how each was chosen, and the link its all-reduces cross."""
    src = profile.source
    ar = profile.operators.get("allreduce") or {}
    link, bandwidth = hardware.group_link(profile.tp)  # across nodes where --tp is more than a node holds
    return {"system": src.get("system"), "device": src.get("device"), "asked_vllm_version": src.get("asked_version"),
            "table_versions": src.get("table_versions"), "table_version_choice": src.get("table_version_choice"),
            "link": link, "link_bandwidth": bandwidth,
            "allreduce": None if not ar else ("custom all-reduce table" if "graph" in ar else "none custom")
            + (", NCCL table" if "nccl" in ar else ", ring over the link")
            + (f", FlashInfer's fused all-reduce up to {ar['fused']['max_bytes'] / 2**20:g} MB from TensorRT-LLM's table"
               if "fused" in ar else ""), "note": tables_note(profile)}


def cmd_from_ops(args) -> int:
    """`sim calibrate --from-ops DIR --system S --model M [--hardware H] [--tp N] [--dtype D] --out P`."""
    from backends.costmodel.optables.profile import build_profile, save_op_profile
    from backends.costmodel.optables.tables import load_tables
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model
    from sim.app.outputs import check_file_destination, command_inputs

    out = Path(args.out)
    if out.suffix != ".json":
        raise ServesimError(f"--out {out}: a profile is a .json file")
    check_file_destination(out, command_inputs(args), overwrite=args.overwrite)
    if args.system is None:
        raise ServesimError("--from-ops needs --system, the tables' system name (e.g. h100_sxm)")
    model = resolve_model(args.model)
    hardware = resolve_hardware(args.hardware) if args.hardware is not None else None
    check_tables_hardware(args.system, args.hardware, hardware)
    if args.tp > 1 and hardware is None:
        raise ServesimError(f"--tp {args.tp} needs --hardware (its link's bandwidth prices the all-reduces no table "
                            "measures)")
    tables = load_tables(args.from_ops, args.system, args.framework, getattr(args, "vllm_version", None))
    profile = build_profile(tables, model.name, model, None if hardware is None else hardware.name, args.tp,
                            model.served_dtype(args.dtype), kv_name(args.kv_cache_dtype),
                            nvlink_bytes_per_s=None if hardware is None else hardware.nvlink_bandwidth,
                            pcie_bytes_per_s=None if hardware is None else hardware.pcie_bandwidth,
                            gpus_per_node=None if hardware is None else hardware.gpus_per_node,
                            inter_node_bytes_per_s=None if hardware is None else hardware.inter_node_bandwidth)
    try:
        save_op_profile(profile, out)  # under a temporary name, then renamed: a full disk keeps the old profile
    except OSError as e:
        raise ServesimError(f"{out}: cannot write ({e.strerror or e}); the file there is unchanged") from None
    if not args.quiet:
        print(format_op_profile(profile))
        print(f"wrote {out}")
    return 0


def check_tables_hardware(system: str, given: str | None, hardware) -> None:
    """Refuse a --hardware that names another GPU than the one the --system tables were measured on
    (H200 with h100_sxm tables): the profile would carry the hardware's name and be taken for its
    kernel times. A hardware file names no system: it is taken as the tables' GPU, as --hardware asks."""
    from backends.costmodel.optables.systems import list_systems, package_systems_dir

    measured_on = None if hardware is None else system_of(hardware)
    if measured_on is None or measured_on == system:
        return
    if system in SYSTEM_HARDWARE or (package_systems_dir() is not None and system in list_systems()):
        wanted = SYSTEM_HARDWARE.get(system, system)
        raise ServesimError(f"--hardware {given} is the GPU of system {measured_on}, but the --system {system} tables "
                            f"were measured on {wanted}: the profile would pass {given}'s name off with {wanted}'s "
                            f"kernel times; give --hardware {wanted} (or a hardware JSON file of that GPU)")


def format_op_profile(profile: OpProfile) -> str:
    """A few lines: what the profile is and some of its step times."""
    import numpy as np

    src = profile.source
    ops = profile.op_model()
    lines = [f"{profile.model} on {src['system']} ({src['device']}), {src['framework']} {src['framework_version']} "
             f"tables: TP {profile.tp}, {profile.dtype} weights, {profile.kv_cache_dtype} KV cache"]
    for batch in (1, 8, 64):
        seconds = ops.total(ops.decode_steps(np.array([batch]), np.array([batch * 2048])))[0]
        lines.append(f"  decode step, {batch} requests at 2048 tokens: {seconds * 1e3:.2f} ms")
    for tokens in (512, 2048, 8192):
        parts = ops.step_parts([tokens], [tokens], 1)
        lines.append(f"  prefill step of {tokens} tokens: {sum(parts.values()) * 1e3:.2f} ms")
    lines += [f"  note: {note}" for note in profile.operators["notes"]]
    return "\n".join(lines)
