"""The shape of a cluster, as the user gave it: colocated replicas behind a router, or a prefill
pool and a decode pool with a KV link between them, each pool with its own options.

KV link defaults, by where the pools sit (a replica has `--tp` GPUs; a node holds the hardware's
`gpus_per_node`, else `GPUS_PER_NODE`):

- inside one node, the hardware's link (`Hardware.link_bandwidth`), else NVLink-class: 450 GB/s
  one way (NVLink 4 on H100/H200 SXM: 900 GB/s both ways together, NVIDIA's datasheet); 5 us to
  set a transfer up;
- across nodes, the hardware's network (`Hardware.inter_node_bandwidth`), else RDMA-class: 50 GB/s
  (one 400 Gb/s InfiniBand NDR or RoCE NIC per GPU, as a DGX H100 has); 20 us (a one-sided RDMA
  write's few microseconds plus the transfer engine's bookkeeping).

Both are assumptions; `--kv-transfer-bandwidth` and `--kv-transfer-latency` override them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sim.config import (
    LINK_BANDWIDTH_GB_S,
    LINK_LATENCY_S,
    POOL_REPLICAS,
    REPLICAS,
    CacheConfig,
    Range,
    SchedulerConfig,
    check_options,
    option,
)
from sim.disagg import KVLink
from sim.errors import ServesimError

if TYPE_CHECKING:
    from backends.hardware import Hardware
    from sim.app.options import ReplayOptions

GPUS_PER_NODE = 8
NVLINK_BANDWIDTH_GB_S, NVLINK_LATENCY_S = 450.0, 5e-6
RDMA_BANDWIDTH_GB_S, RDMA_LATENCY_S = 50.0, 2e-5

# What a pool may set for itself (--prefill-options / --decode-options KEY=VALUE,...), named as the
# replay flags are (--num-blocks is --num-gpu-blocks' other name). Where each is held, its type and
# its range are its field's (`pool_fields`).
POOL_OPTIONS = ("policy", "max-num-batched-tokens", "max-num-seqs", "max-num-active-seqs", "num-gpu-blocks", "num-blocks",
                "block-size", "gpu-memory-utilization", "hardware", "tp", "dtype", "kv-cache-dtype", "profile")


def pool_fields() -> dict[str, tuple[str | None, str, Range | None]]:
    """KEY -> (the options part that holds it: scheduler, cache or None for ReplayOptions itself,
    its field, its range: None for text), from the fields' declarations."""
    from sim.app.options import ReplayOptions, flag_fields

    table: dict[str, tuple[str | None, str, Range | None]] = {}
    for part, cls in (("scheduler", SchedulerConfig), ("cache", CacheConfig), (None, ReplayOptions)):
        for f, opt in flag_fields(cls):
            for flag in (opt.flag, *opt.aliases):
                if flag[2:] in POOL_OPTIONS:
                    table[flag[2:]] = (part, f.name, opt.range)
    return table


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ServesimError(message)


POOL_FLAGS = {"prefill": "--prefill-options", "decode": "--decode-options"}


@contextmanager
def naming_pool(flag: str) -> Iterator[None]:
    """A refusal raised inside, while a pool's options are built or resolved, names the pool's flag
    (`--decode-options: --max-num-active-seqs (64) cannot be greater than --max-num-seqs (32)`): the value
    refused may be the pool's own. A message that already names the flag is left as it is."""
    try:
        yield
    except ServesimError as e:
        if flag in str(e):
            raise
        raise ServesimError(f"{flag}: {e}") from None


def parse_pool_options(text: str, flag: str) -> tuple[tuple[str, object], ...]:
    """'policy=prefill-first,max-num-batched-tokens=8192' -> (('policy', 'prefill-first'), ...)."""
    pairs: dict[str, object] = {}
    keys_of: dict[str, str] = {}  # the field each key given sets: an alias (num-blocks) sets num-gpu-blocks' too
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, raw = part.partition("=")
        key = key.strip().replace("_", "-")
        _require(sep == "=" and key in POOL_OPTIONS,
                 f"{flag}: cannot read {part!r}; expected KEY=VALUE with KEY one of {', '.join(POOL_OPTIONS)}")
        field = pool_fields()[key][1]
        _require(field not in keys_of, f"{flag}: {key} is given twice"
                 + (f" (as {keys_of[field]})" if keys_of.get(field, key) != key else ""))
        keys_of[field] = key
        bounds = pool_fields()[key][2]
        if bounds is None:
            _require(raw.strip() != "", f"{flag}: {key} has no value; give {key}=VALUE, or leave {key} out for the "
                                        "run's own")
            pairs[key] = raw.strip()
            continue
        try:  # the replay flag's own parsing and range, named by the pool's flag and key
            pairs[key] = bounds.flag_type(f"{flag}: {key}")(raw.strip())
        except ValueError:
            raise ServesimError(f"{flag}: {key} value {raw.strip()!r} is not "
                                f"{'a whole number' if bounds.whole else 'a number'}") from None
    return tuple(pairs.items())


@dataclass(frozen=True)
class ClusterOptions:
    num_replicas: int = option(1, flag="--replicas", range=REPLICAS, metavar="N",
                               help="colocated replicas, each an engine with its own policy and KV cache "
                                    "(default: {default})")
    router: str = option("round-robin", flag="--router",
                         help="which replica takes each request: {routers} (default: {default}), or your own as "
                              "path/to/file.py:ClassName")
    num_prefill_replicas: int = option(0, flag="--prefill-replicas", range=POOL_REPLICAS, metavar="P",
                                       help="disaggregated: replicas that prefill and emit the first token")
    num_decode_replicas: int = option(0, flag="--decode-replicas", range=POOL_REPLICAS, metavar="D",
                                      help="disaggregated: replicas that decode once a request's KV blocks have "
                                           "arrived")
    # None: by where the pools sit (module docstring)
    kv_transfer_bandwidth_gb_s: float | None = option(
        None, flag="--kv-transfer-bandwidth", range=LINK_BANDWIDTH_GB_S, metavar="GB/S",
        help="KV link bandwidth per transfer (default: the hardware's link when the pools' GPUs fit in one node, "
             "its network between nodes otherwise, as `sim hardware` lists them; "
             f"{NVLINK_BANDWIDTH_GB_S:g} and {RDMA_BANDWIDTH_GB_S:g} GB/s with {GPUS_PER_NODE}-GPU nodes where the "
             "hardware states no node)")
    kv_transfer_latency_s: float | None = option(
        None, flag="--kv-transfer-latency", range=LINK_LATENCY_S, metavar="S",
        help=f"KV link setup time per transfer (default: {NVLINK_LATENCY_S:g} s inside a node, {RDMA_LATENCY_S:g} s "
             "across nodes)")
    # KEY=VALUE,... for the prefill pool (POOL_OPTIONS)
    prefill_options: str = option("", flag="--prefill-options", metavar="KEY=VALUE,...", joined=True,
                                  help="the prefill pool's own settings, KEY one of {pool_options}")
    decode_options: str = option("", flag="--decode-options", metavar="KEY=VALUE,...", joined=True,
                                 help="the decode pool's own settings, KEY one of {pool_options}")

    def __post_init__(self) -> None:
        check_options(self)
        p, d = self.num_prefill_replicas, self.num_decode_replicas
        _require((p == 0) == (d == 0),
                 f"disaggregation needs both pools: got --prefill-replicas {p} and --decode-replicas {d}")
        _require(not (p and self.num_replicas > 1),
                 f"--replicas {self.num_replicas} counts colocated replicas; with --prefill-replicas and "
                 "--decode-replicas leave it out")
        if not p:
            _require(self.kv_transfer_bandwidth_gb_s is None and self.kv_transfer_latency_s is None
                     and not self.prefill_options and not self.decode_options,
                     "--kv-transfer-*, --prefill-options and --decode-options apply only with "
                     "--prefill-replicas and --decode-replicas")
        parse_pool_options(self.prefill_options, "--prefill-options")
        parse_pool_options(self.decode_options, "--decode-options")
        if p:
            self.kv_link()  # KVLink checks its figures (without the pools there is no link: its flags are refused above)

    @property
    def is_disaggregated(self) -> bool:
        return self.num_prefill_replicas > 0

    @property
    def total_replicas(self) -> int:
        return self.num_prefill_replicas + self.num_decode_replicas if self.is_disaggregated else self.num_replicas

    @property
    def is_single(self) -> bool:
        """One colocated replica: exactly a lone engine, and the same files."""
        return not self.is_disaggregated and self.num_replicas == 1

    def kv_link(self, num_gpus: int | None = None, hardware: Hardware | None = None, across: bool = False) -> KVLink:
        """The link, its defaults by whether the cluster's `num_gpus` (default: one per replica)
        fit in one node (`across`: they do not, whatever their number): `hardware`'s node where it
        states one (backends.hardware.Hardware), else the module's figures."""
        per_node, inside_gb_s, across_gb_s = GPUS_PER_NODE, NVLINK_BANDWIDTH_GB_S, RDMA_BANDWIDTH_GB_S
        if hardware is not None and hardware.gpus_per_node is not None:
            per_node = hardware.gpus_per_node
            if hardware.link_bandwidth is not None:
                inside_gb_s = hardware.link_bandwidth / 1e9
            if hardware.inter_node_bandwidth is not None:
                across_gb_s = hardware.inter_node_bandwidth / 1e9
        inside_a_node = not across and (num_gpus or self.total_replicas) <= per_node
        bandwidth = self.kv_transfer_bandwidth_gb_s
        latency = self.kv_transfer_latency_s
        if bandwidth is None:
            bandwidth = inside_gb_s if inside_a_node else across_gb_s
        if latency is None:
            latency = NVLINK_LATENCY_S if inside_a_node else RDMA_LATENCY_S
        return KVLink(bandwidth, latency)

    def pool(self, base: "ReplayOptions", role: str) -> "ReplayOptions":
        """The options of one pool's replicas: `base` with the pool's own settings, as a lone engine's."""
        text, flag = self.pool_options(role)
        with naming_pool(flag):
            return self._pool(base, role, text, flag)

    def pool_options(self, role: str) -> tuple[str, str]:
        """The pool's own settings as given, and their flag."""
        return (self.prefill_options if role == "prefill" else self.decode_options), POOL_FLAGS[role]

    def _pool(self, base: "ReplayOptions", role: str, text: str, flag: str) -> "ReplayOptions":
        top: dict = {"cluster": ClusterOptions()}
        parts: dict[str, dict] = {"scheduler": {}, "cache": {}}
        fields_by_key = pool_fields()
        for key, value in parse_pool_options(text, flag):
            part, name, _ = fields_by_key[key]
            (top if part is None else parts[part])[name] = value
        if role == "decode":
            parts["cache"]["enable_prefix_caching"] = False  # decode replicas hold transferred KV only
        # A scheduler value the pool sets is given, not left to vLLM's default for the GPU (batch_defaults).
        top["batch_defaults"] = tuple(name for name in base.batch_defaults if name not in parts["scheduler"])
        from sim.app.options import batch_placeholders

        given = {**{k: getattr(base.scheduler, k) for k in ("max_num_batched_tokens", "max_num_seqs")},
                 **parts["scheduler"]}
        parts["scheduler"].update(batch_placeholders(top["batch_defaults"], given["max_num_batched_tokens"],
                                                     given["max_num_seqs"]))
        return replace(base, scheduler=replace(base.scheduler, **parts["scheduler"]),
                       cache=replace(base.cache, **parts["cache"]), **top)
