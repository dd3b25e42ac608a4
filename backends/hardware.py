"""One GPU's datasheet figures, from a preset or a JSON file (`--hardware NAME|FILE.json`).

A hardware file is one JSON object with these fields (numbers in base units):

    {"peak_bf16_flops": 989.4e12,      dense bf16 tensor-core FLOP/s
     "peak_fp8_flops": 1978.9e12,      dense fp8 FLOP/s; null: no fp8 tensor cores (fp8 weights are
                                       then dequantised and multiplied at the bf16 peak, as vLLM's
                                       weight-only fp8 does on Ampere)
     "memory_bandwidth": 3.35e12,      HBM bytes/s
     "memory_bytes": 85020000000,      device memory as CUDA reports it (cudaMemGetInfo's total,
                                       torch.cuda.get_device_properties().total_memory): what vLLM
                                       multiplies by --gpu-memory-utilization. nvidia-smi shows a
                                       few hundred MiB more.
     "nvlink_bandwidth": 450e9,        bytes/s one GPU sends to the others in one direction (the
                                       datasheet's NVLink figure counts both directions: half of
                                       it); null: no NVLink
     "pcie_bandwidth": 64e9,           optional: where nvlink_bandwidth is null, the PCIe link's
                                       bytes/s one GPU sends to another, one direction (--tp > 1
                                       over PCIe); neither: --tp 1 only
     "gpus_per_node": 8,               optional: GPUs that share the link above (a server, or an
                                       NVLink rack); a group of more GPUs (--tp, an expert-parallel
                                       group) crosses nodes
     "inter_node_bandwidth": 50e9,     optional: bytes/s one GPU sends to another node, one
                                       direction (its network adapter: ConnectX-7 400 Gb/s is 50e9)
     "description": "..."}             optional

`--hardware` also takes a system AIConfigurator's package describes (h100_sxm, l40s, ...; `sim
hardware` lists them), its figures from the package's systems/<system>.yaml (backends/costmodel/optables/systems.py).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from sim.errors import ServesimError
from sim.jsonable import read_json_file

MIB = 2**20


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16_flops: float
    peak_fp8_flops: float | None
    memory_bandwidth: float
    memory_bytes: int
    nvlink_bandwidth: float | None
    description: str = ""
    pcie_bandwidth: float | None = None  # the link where there is no NVLink
    system: str | None = None  # the package's system it describes (its tables price it), if any
    gpus_per_node: int | None = None  # GPUs sharing the link above; None: not stated (one node)
    inter_node_bandwidth: float | None = None  # bytes/s one GPU sends to another node, one direction

    def __post_init__(self) -> None:
        check_hardware_fields(self)

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense tensor-core FLOP/s for GEMMs whose weights are in `dtype` (bf16 or fp8)."""
        if dtype == "fp8" and self.peak_fp8_flops is not None:
            return self.peak_fp8_flops
        return self.peak_bf16_flops

    @property
    def link(self) -> str | None:
        """The GPUs' link for tensor parallelism: nvlink, pcie, or None (--tp 1 only)."""
        return "nvlink" if self.nvlink_bandwidth is not None else ("pcie" if self.pcie_bandwidth is not None else None)

    @property
    def link_bandwidth(self) -> float | None:
        return self.nvlink_bandwidth if self.nvlink_bandwidth is not None else self.pcie_bandwidth

    def spans_nodes(self, num_gpus: int) -> bool:
        """Whether a group of `num_gpus` GPUs (a TP group, an expert-parallel group) crosses nodes."""
        return self.gpus_per_node is not None and num_gpus > self.gpus_per_node

    def group_link(self, num_gpus: int, members: int | None = None) -> tuple[str | None, float | None]:
        """(link, bytes/s one GPU sends) of a collective among `num_gpus` GPUs (`node_link`); `members`:
        a group of fewer GPUs spread over those (a DP group's stand TP apart), named so in a refusal."""
        return node_link(self.link, self.link_bandwidth, num_gpus, self.gpus_per_node, self.inter_node_bandwidth,
                         f"hardware {self.name}", members)

    def check_tp(self, tp: int) -> None:
        if tp > 1 and self.link is None:
            raise ServesimError(f"--tp {tp} needs a link between the GPUs; hardware {self.name} has neither "
                                "nvlink_bandwidth nor pcie_bandwidth")

    def as_dict(self) -> dict:
        """The fields (summary.json): the link's own (nvlink_bandwidth, or pcie_bandwidth where it is
        the link), the package system where it is one."""
        d = asdict(self)
        for key in ("pcie_bandwidth", "system", "gpus_per_node", "inter_node_bandwidth"):
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_json(cls, path: str | Path) -> Hardware:
        p = Path(path)
        raw = read_json_file(p, "hardware file")
        names = [f.name for f in fields(cls) if f.name not in ("name", "system")]
        unknown = sorted(set(raw) - set(names))
        if "name" in unknown or "system" in unknown:  # summary.json's hardware object, copied whole
            raise ServesimError(f"{p}: field {'name' if 'name' in unknown else 'system'!r}: a hardware file is named "
                                "by its file's name, and a system of the tables extra by --hardware SYSTEM; leave "
                                "name and system out (summary.json's hardware object carries both)")
        if unknown:
            raise ServesimError(f"{p}: unknown field {unknown[0]!r}; a hardware file has {', '.join(names)}")
        missing = [n for n in names if n not in raw and n not in ("description", "pcie_bandwidth", "gpus_per_node",
                                                                  "inter_node_bandwidth")]
        if missing:
            raise ServesimError(f"{p}: no {missing[0]} in it (null where the GPU has none: peak_fp8_flops, "
                                "nvlink_bandwidth)")
        if not isinstance(raw.get("description", ""), str):
            raise ServesimError(f"{p}: description must be text")
        for whole in ("memory_bytes", "gpus_per_node"):  # JSON may write a whole number as 8.0
            value = raw.get(whole)
            if isinstance(value, float) and value.is_integer():
                raw[whole] = int(value)
        try:
            hardware = cls(name=p.stem, **raw)
        except ServesimError as e:
            raise ServesimError(f"{p}: {e}") from None
        preset = HARDWARE.get(hardware.name)
        if preset is not None:
            # The name picks the preset's measured profiles (profiles/ops/) and its system's tables, which
            # would price this file's GPU with the preset's kernel times, whatever its figures say.
            differ = [f.name for f in fields(cls) if f.name != "description"
                      and getattr(hardware, f.name) != getattr(preset, f.name)]
            if differ:
                raise ServesimError(f"{p}: named like the preset {preset.name}, whose measured operator tables "
                                    f"would price it, but its figures differ from the preset's ({', '.join(differ)}); "
                                    "rename the file (its name names the hardware)")
        return hardware


def node_link(link: str | None, bandwidth: float | None, num_gpus: int, gpus_per_node: int | None,
              inter_node_bandwidth: float | None, what: str, members: int | None = None
              ) -> tuple[str | None, float | None]:
    """(link, bytes/s one GPU sends) of a collective among `num_gpus` GPUs whose node shares `link`
    at `bandwidth`: that link within a node; across nodes the slower of it and the network between
    nodes (a ring's bottleneck: each GPU's traffic to the next node crosses its network adapter).
    A group past a node whose network is not stated is refused (`what` names the hardware)."""
    if gpus_per_node is not None and num_gpus > gpus_per_node:
        if inter_node_bandwidth is None:
            group = (f"{num_gpus} GPUs in one group" if members is None or members == num_gpus else
                     f"a group of {members} GPUs spread over {num_gpus} (a DP group's stand --tp apart)")
            raise ServesimError(f"{group} span nodes of {gpus_per_node} on {what}, which states no "
                                "inter_node_bandwidth to price what crosses them")
        if bandwidth is None or inter_node_bandwidth < bandwidth:
            return "inter-node", inter_node_bandwidth
    return link, bandwidth


def check_hardware_fields(hardware: Hardware) -> None:
    """Each figure of a GPU within its physical range (sim.config: FLOPS, MEMORY_BANDWIDTH,
    MEMORY_BYTES, NVLINK_BANDWIDTH, each with its reason); null only where the GPU may have none."""
    from sim.config import FLOPS, GPUS_PER_NODE, MEMORY_BANDWIDTH, MEMORY_BYTES, NVLINK_BANDWIDTH

    ranges = {"peak_bf16_flops": FLOPS, "peak_fp8_flops": FLOPS, "memory_bandwidth": MEMORY_BANDWIDTH,
              "memory_bytes": MEMORY_BYTES, "nvlink_bandwidth": NVLINK_BANDWIDTH,
              "pcie_bandwidth": NVLINK_BANDWIDTH,  # a link's range: from 1 Gb/s Ethernet to 100 x NVLink 5
              "gpus_per_node": GPUS_PER_NODE, "inter_node_bandwidth": NVLINK_BANDWIDTH}
    for field, bounds in ranges.items():
        value = getattr(hardware, field)
        if value is None and field in ("peak_fp8_flops", "nvlink_bandwidth", "pcie_bandwidth", "gpus_per_node",
                                       "inter_node_bandwidth"):
            continue
        if not bounds.contains(value):
            bounds.check(f"hardware {hardware.name}: {field}", value)


# Datasheet figures. Sources: NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 312 TFLOP/s dense
# bf16, 2,039 GB/s HBM2e, NVLink 600 GB/s; no fp8), NVIDIA H100 Tensor Core GPU datasheet (SXM5:
# 989.4 TFLOP/s dense bf16 and 1,978.9 dense fp8 (the datasheet's 1,979 and 3,958 are with
# sparsity), 3.35 TB/s HBM3, NVLink 900 GB/s), NVIDIA H200 product brief (SXM: same tensor cores
# as the H100, 4.8 TB/s HBM3e, NVLink 900 GB/s). Memory as CUDA reports it, from
# torch.cuda.get_device_properties printouts: H100 80GB HBM3 81082 MiB (vLLM logs "79.18 GiB"),
# H200 143156 MiB, A100-SXM4-80GB 81920 MiB. Nodes: 8 GPUs on one NVLink switch (HGX/DGX A100,
# H100 and H200), each GPU with its own network adapter to other nodes: ConnectX-6 200 Gb/s on DGX
# A100 (25 GB/s one way), ConnectX-7 400 Gb/s on DGX H100 and H200 (50 GB/s), as the package's
# systems/*.yaml state them too (node.inter_node_bw).
HARDWARE: dict[str, Hardware] = {
    "A100-80GB": Hardware("A100-80GB", 312e12, None, 2.039e12, 81920 * MIB, 300e9, "NVIDIA A100 SXM4 80GB",
                          gpus_per_node=8, inter_node_bandwidth=25e9),
    "H100-SXM": Hardware("H100-SXM", 989.4e12, 1978.9e12, 3.35e12, 81082 * MIB, 450e9, "NVIDIA H100 SXM5 80GB",
                         gpus_per_node=8, inter_node_bandwidth=50e9),
    "H200": Hardware("H200", 989.4e12, 1978.9e12, 4.8e12, 143156 * MIB, 450e9, "NVIDIA H200 SXM 141GB",
                     gpus_per_node=8, inter_node_bandwidth=50e9),
}


def resolve_hardware(name_or_path: str) -> Hardware:
    """A preset's name, a path to a hardware JSON file, or a system of AIConfigurator's package."""
    if not name_or_path.strip():  # (Path("") is the current folder: ".: cannot read the hardware file")
        raise ServesimError("--hardware must not be empty (an empty name was read as the current folder)")
    if name_or_path in HARDWARE:
        return HARDWARE[name_or_path]
    if name_or_path.endswith(".json") or Path(name_or_path).exists():
        return Hardware.from_json(name_or_path)
    from backends.costmodel.optables.systems import INSTALL_HINT, list_systems, package_systems_dir, system_hardware

    if package_systems_dir() is None:
        if re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)+|[a-z]+\d+[a-z]*", name_or_path):  # a system's name, e.g. l40s
            raise ServesimError(f"unknown hardware {name_or_path!r}: the package's systems need the tables extra, "
                                f"{INSTALL_HINT}; presets: {', '.join(HARDWARE)}")
    elif name_or_path in list_systems():
        return system_hardware(name_or_path)
    raise ServesimError(f"unknown hardware {name_or_path!r}: not a preset ({', '.join(HARDWARE)}), a package system "
                        "or a JSON file; see `sim hardware`")
