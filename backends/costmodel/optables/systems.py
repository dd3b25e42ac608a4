"""The field's published tables: AIConfigurator's systems and their operator tables, in its own layout.

The optional extra (`pip install -e '.[tables]'`) installs `aiconfigurator-core` (Apache-2.0), whose
folder `aiconfigurator_core/systems/` holds

    <system>.yaml                                    one GPU system's figures (gpu:, node:, misc:)
    data/<system>/<family>/<framework>/<version>/<table>.parquet
    data/<system>/<family>/<framework>/<version>/reuse.yaml   this version reads `table` from `from_version`
    perf_data_reuse_manifest.yaml                    which frameworks may read each (table, kernel_source)

with `family` gemm, attention, comm, moe, mla, linear_attention ... and the tables (`latency` in ms)
described in ../shared/gpu-data/SOURCES.md. `--ops DIR` takes a folder of the same layout too
(DIR/systems/data, DIR/data or DIR itself holding <system>/<family>/...).

Reading is one generic function, `read_layout_table(data_dir, system, family, framework, table,
version)`: any family's table is read the same way (this module reads gemm, attention, comm and
comm/nccl; moe/moe_perf, mla/mla_*_module_perf and comm/nccl/nccl_perf are read by the same call),
with the version chosen by `choose_version` (the one asked for, else the nearest the system has,
ties to the newer) and `reuse.yaml` followed. The caller filters rows by `kernel_source` with
`kernel_allowed` (the manifest's inheritance whitelist).

Nothing here imports aiconfigurator_core's code: the package is found by `importlib.util.find_spec`
and its files are read with pyyaml and pandas.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from sim.errors import ServesimError

if TYPE_CHECKING:
    import pandas as pd

PACKAGE = "aiconfigurator_core"
DISTRIBUTION = "aiconfigurator-core"
INSTALL_HINT = "pip install -e '.[tables]'"
FRAMEWORK = "vllm"
# servesim's table kinds -> (family folder, table file stem) in the package's layout.
TABLES = {"gemm": ("gemm", "gemm_perf"), "context_attention": ("attention", "context_attention_perf"),
          "generation_attention": ("attention", "generation_attention_perf"),
          "custom_allreduce": ("comm", "custom_allreduce_perf")}
MANIFEST = "perf_data_reuse_manifest.yaml"


def package_systems_dir() -> Path | None:
    """aiconfigurator_core/systems where the package is installed, else None (it is not imported)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "systems"
    return folder if folder.is_dir() else None


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


def require_package() -> Path:
    folder = package_systems_dir()
    if folder is None:
        raise ServesimError(f"the field's published tables are not installed: {INSTALL_HINT} "
                            f"(installs {DISTRIBUTION}==0.12.0)")
    return folder


def _yaml(path: Path):
    try:
        import yaml  # a dependency of aiconfigurator-core: present wherever the package is
    except ImportError:
        raise ServesimError(f"{path}: reading it needs pyyaml (pip install pyyaml, or {INSTALL_HINT})") from None

    try:  # libyaml's parser where PyYAML has it (the same objects as safe_load's, several times faster)
        return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ServesimError(f"{path}: cannot read it: {' '.join(str(e).split())}") from None


def version_key(version: str) -> tuple:
    """A version's numbers for ordering: 0.24.0 -> (0, 24, 0); a suffix (rc1, post2) ranks after its base."""
    parts = re.findall(r"\d+", version)
    return tuple(int(p) for p in parts[:3]) + (0,) * (3 - min(3, len(parts))) + (version,)


def _distance(a: str, b: str) -> int:
    """How far apart two versions are on one number line: major x 10^6 + minor x 10^3 + patch."""
    ka, kb = version_key(a)[:3], version_key(b)[:3]
    return abs(sum(x * 1000**(2 - i) for i, x in enumerate(ka)) - sum(y * 1000**(2 - i) for i, y in enumerate(kb)))


def choose_version(available, wanted: str | None) -> tuple[str, str]:
    """(the version to read, how it was chosen): `wanted` itself, else the nearest available
    (`_distance`; a tie goes to the newer); None: the newest."""
    available = sorted(set(available), key=version_key)
    if not available:
        raise ValueError("no versions")
    if wanted is None:
        return available[-1], "the newest"
    if wanted in available:
        return wanted, "as asked"
    best = min(reversed(available), key=lambda v: _distance(v, wanted))
    return best, f"the nearest to {wanted} (available: {', '.join(available)})"


def versions_by_nearness(available, wanted: str | None) -> list[tuple[str, str]]:
    """Every available version with how it would be chosen, the one `choose_version` picks first,
    then the next nearest to `wanted` (None: the newest first), and so on."""
    first, how = choose_version(available, wanted)
    rest = sorted(set(available) - {first}, key=version_key, reverse=True)  # ties (after the sort below) to the newer
    if wanted is not None:
        rest.sort(key=lambda v: _distance(v, wanted))
    return [(first, how)] + [(v, f"the next nearest to {wanted or 'the newest'}") for v in rest]


def find_data_dir(folder: str | Path) -> Path | None:
    """The `data` folder of a tree in the package's layout (DIR/systems/data, DIR/data, DIR), else None."""
    folder = Path(folder)
    for candidate in (folder / "systems" / "data", folder / "data", folder):
        if candidate.is_dir() and any(any((s / f).is_dir() for f in ("gemm", "attention", "comm"))
                                      for s in candidate.iterdir() if s.is_dir()):
            return candidate
    return None


def layout_systems(data_dir: Path, framework: str = FRAMEWORK) -> list[str]:
    """Systems with at least a GEMM table for `framework` in a layout's data folder."""
    return sorted(s.name for s in data_dir.iterdir()
                  if s.is_dir() and table_versions(data_dir, s.name, "gemm", framework, "gemm_perf"))


def _reuse(folder: Path) -> dict[str, str]:
    """table stem -> the version it is read from, per the version folder's reuse.yaml."""
    path = folder / "reuse.yaml"
    if not path.is_file():
        return {}
    raw = _yaml(path) or {}
    entries = (raw.get("reuse") or []) if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ServesimError(f"{path}: not a reuse file: expected a mapping with a list `reuse` of entries")
    out = {}
    for entry in entries:
        if not (isinstance(entry, dict) and "table" in entry and "from_version" in entry):
            raise ServesimError(f"{path}: each reuse entry needs table and from_version")
        source = str(entry["from_version"])
        if not source or source in (".", "..") or "/" in source or "\\" in source:
            raise ServesimError(f"{path}: from_version {source!r} is not a version folder's name")
        out[str(entry["table"])] = source
    return out


def _table_file(folder: Path, table: str) -> Path | None:
    """The version folder's file of `table` (.parquet or .csv), None where there is none; both is refused."""
    found = [folder / (table + ext) for ext in (".parquet", ".csv") if (folder / (table + ext)).is_file()]
    if len(found) > 1:
        raise ServesimError(f"{found[0]} and {found[1].name}: one table in two files; keep one")
    return found[0] if found else None


def table_versions(data_dir: Path, system: str, family: str, framework: str, table: str) -> dict[str, list[Path]]:
    """version -> the files that version reads for `table`: its own, then the one its reuse.yaml
    names (rows the version's own table lacks are read from there; a version with no table of its
    own reads that one whole)."""
    root = data_dir / system / family / framework
    if not root.is_dir():
        return {}
    out = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = []
        own = _table_file(folder, table)
        if own is not None:
            files.append(own)
        source = _reuse(folder).get(table)
        if source is not None:
            donor = _table_file(root / source, table)
            if donor is None:
                raise ServesimError(f"{folder / 'reuse.yaml'}: {table} from version {source}, which has no such "
                                    f"table ({root / source})")
            files.append(donor)
        if files:
            out[folder.name] = files
    return out


@dataclass(frozen=True)
class LayoutTable:
    """One table read from the layout: which version was chosen, how, and the files read (the
    version's own, then a reuse.yaml donor's; the donor's rows are marked `reused`)."""

    table: str
    version: str  # the version folder chosen
    how: str  # how it was chosen
    paths: tuple[Path, ...]
    frame: pd.DataFrame

    @property
    def path(self) -> Path:
        return self.paths[0]


def _key_columns(frame) -> list[str]:
    skip = {"latency", "seconds", "version", "framework", "device", "power", "reused", "backend"}
    return [c for c in frame.columns if c not in skip]


def read_layout_table(data_dir: Path, system: str, family: str, framework: str, table: str,
                      version: str | None) -> LayoutTable | None:
    """One table of any family (gemm, attention, comm, moe, mla, or comm/nccl with framework
    'nccl') at `version` or the nearest there is; None where the system has none for `framework`.
    Rows a reuse.yaml donor adds carry `reused` True: a kernel's choice prefers the version's own."""
    versions = table_versions(data_dir, system, family, framework, table)
    if not versions:
        return None
    chosen, how = choose_version(versions, version)
    return _read_version(table, chosen, how, versions[chosen])


def read_layout_tables(data_dir: Path, system: str, family: str, framework: str, table: str,
                       version: str | None) -> list[LayoutTable]:
    """`read_layout_table` at every version the system has, nearest to `version` first
    (`versions_by_nearness`): for a caller that takes a shape the chosen version does not measure
    from the next nearest that does. [] where the system has none."""
    versions = table_versions(data_dir, system, family, framework, table)
    if not versions:
        return []
    return [_read_version(table, chosen, how, versions[chosen])
            for chosen, how in versions_by_nearness(versions, version)]


def _read_version(table: str, chosen: str, how: str, paths: list[Path]) -> LayoutTable:
    import pandas as pd

    from backends.costmodel.optables.tables import read_frame

    frames = [read_frame(path, table).assign(reused=i > 0) for i, path in enumerate(paths)]
    frame = frames[0]
    if len(frames) > 1:  # the version's own rows win where the donor measured the same key
        both = pd.concat(frames, ignore_index=True)
        frame = both.drop_duplicates(subset=_key_columns(frames[0]), keep="first").reset_index(drop=True)
    donors = [path.parent.name for path in paths if path.parent.name != chosen]
    if donors:  # said wherever the version is said (summary.json, the terminal, a profile's source)
        how += (f"; its rows and {donors[0]}'s rows by its reuse.yaml" if len(paths) > 1
                else f"; its rows read from {donors[0]} by its reuse.yaml")
    return LayoutTable(table, chosen, how, tuple(paths), frame)


def system_sm_version(system: str) -> int | None:
    """The GPU's compute capability as the package's <system>.yaml states it (gpu.sm_version: 90 for
    H100 and H200, 100 for B200, 103 for B300), None where the package does not describe `system`."""
    folder = package_systems_dir()
    path = None if folder is None else folder / f"{system}.yaml"
    if path is None or not path.is_file() or not _is_system(path):
        return None
    sm = (_yaml(path).get("gpu") or {}).get("sm_version")
    return int(sm) if isinstance(sm, (int, float)) and not isinstance(sm, bool) else None


@lru_cache(maxsize=4)
def _manifest(path: str) -> dict[tuple[str, str], tuple[str, ...]]:
    raw = _yaml(Path(path)) or {}
    groups = (raw.get("groups") or []) if isinstance(raw, dict) else None
    if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)):
        raise ServesimError(f"{path}: not a reuse manifest: expected a mapping with a list `groups` of mappings")
    out = {}
    for g in groups:
        frameworks = g.get("frameworks") or []
        if not isinstance(frameworks, list):
            raise ServesimError(f"{path}: a group's frameworks must be a list, not {frameworks!r}")
        out[(str(g.get("op_file", "")).rsplit(".", 1)[0], str(g.get("kernel_source")))] = \
            tuple(str(f) for f in frameworks)
    return out


def kernel_allowed(data_dir: Path, table: str, kernel: str, framework: str = FRAMEWORK) -> bool:
    """Whether `framework` may read rows of `kernel` in `table`, per the layout's reuse manifest
    (next to data/; a kernel it does not name, or no manifest, is allowed)."""
    path = data_dir.parent / MANIFEST
    if not path.is_file():
        return True
    frameworks = _manifest(str(path)).get((table, kernel))
    return frameworks is None or framework in frameworks or table == "nccl_perf"


# -- system descriptions -----------------------------------------------------------------------------


def list_systems() -> list[str]:
    """The systems the installed package describes (a <system>.yaml with a gpu: section)."""
    folder = package_systems_dir()
    if folder is None:
        return []
    return sorted(p.stem for p in folder.glob("*.yaml") if _is_system(p))


@lru_cache(maxsize=64)
def _is_system(path: Path) -> bool:
    raw = _yaml(path)
    return isinstance(raw, dict) and isinstance(raw.get("gpu"), dict) and "data_dir" in raw


def system_description(name: str) -> dict:
    folder = require_package()
    path = folder / f"{name}.yaml"
    if not path.is_file() or not _is_system(path):
        raise ServesimError(f"unknown system {name!r}; the package describes {', '.join(list_systems())}")
    return _yaml(path)


def system_data_dir(name: str) -> Path:
    raw = system_description(name)
    return require_package() / str(raw["data_dir"]).split("#")[0].strip()


def system_hardware(name: str):
    """A `Hardware` from the package's <system>.yaml: its figures as the file states them.

    gpu.bfloat16_tc_flops, gpu.fp8_tc_flops (absent: none), gpu.mem_bw, gpu.mem_capacity; the link:
    NVLink (`nvlink_bandwidth` = node.intra_node_bw) where intra_node_bw is more than the PCIe
    figure, else PCIe (`pcie_bandwidth` = node.intra_node_bw, what one GPU sends to another without
    NVLink, one direction); the node: node.num_gpus_per_node share that link, node.inter_node_bw
    (`inter_node_bandwidth`) reaches the others (both optional)."""
    from backends.hardware import Hardware

    raw = system_description(name)
    gpu, node = raw.get("gpu") or {}, raw.get("node") or {}
    try:
        intra = float(node["intra_node_bw"])
        pcie = float(node.get("pcie_bw", intra))
        fp8 = gpu.get("fp8_tc_flops")
        nvlink = intra > pcie
        per_node, inter = node.get("num_gpus_per_node"), node.get("inter_node_bw")
        return Hardware(name, float(gpu["bfloat16_tc_flops"]), None if fp8 is None else float(fp8),
                        float(gpu["mem_bw"]), int(gpu["mem_capacity"]), intra if nvlink else None,
                        f"{name} ({DISTRIBUTION} {package_version()} systems/{name}.yaml)",
                        pcie_bandwidth=None if nvlink else intra, system=name,
                        gpus_per_node=None if per_node is None else int(per_node),
                        inter_node_bandwidth=None if inter is None else float(inter))
    except (KeyError, TypeError, ValueError) as e:
        raise ServesimError(f"systems/{name}.yaml: cannot read its figures ({e})") from None


def system_table_versions(name: str, framework: str = FRAMEWORK) -> dict[str, list[str]]:
    """kind -> the versions the system has tables for (for `sim hardware`)."""
    data_dir = system_data_dir(name).parent
    return {kind: sorted(table_versions(data_dir, name, family, framework, table), key=version_key)
            for kind, (family, table) in TABLES.items()}


def has_tables(name: str, framework: str = FRAMEWORK) -> bool:
    """Whether the package has `framework` GEMM tables for system `name` (else it runs on the roofline)."""
    return bool(system_table_versions(name, framework)["gemm"])
