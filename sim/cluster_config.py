"""The shape of a cluster: colocated replicas behind a router, or prefill and decode pools with
a KV link between them.

KV link defaults, by where the pools sit (one replica per GPU; a node holds `GPUS_PER_NODE`):

- inside one node, NVLink-class: 450 GB/s one way (NVLink 4 on H100/H200 SXM: 18 links, 900 GB/s
  both ways together, NVIDIA's datasheet) and 5 us to set a transfer up;
- across nodes, RDMA-class: 50 GB/s (one 400 Gb/s InfiniBand NDR or RoCE NIC per GPU, as a DGX
  H100 has) and 20 us (a one-sided RDMA write's few microseconds plus the transfer engine's
  bookkeeping).

Both are assumptions to override with `--kv-transfer-bandwidth` and `--kv-transfer-latency`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.errors import ServesimError

GPUS_PER_NODE = 8
NVLINK_BANDWIDTH_GB_S, NVLINK_LATENCY_S = 450.0, 5e-6
RDMA_BANDWIDTH_GB_S, RDMA_LATENCY_S = 50.0, 2e-5


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ServesimError(message)


@dataclass(frozen=True)
class KVLink:
    """The link a request's KV blocks cross from its prefill replica to its decode replica. Each
    transfer has the link's full bandwidth (no contention between transfers)."""

    bandwidth_gb_s: float
    latency_s: float

    def __post_init__(self) -> None:
        _require(self.bandwidth_gb_s > 0, f"--kv-transfer-bandwidth must be positive (GB/s), got {self.bandwidth_gb_s}")
        _require(self.latency_s >= 0, f"--kv-transfer-latency must be at least 0 (s), got {self.latency_s}")

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / (self.bandwidth_gb_s * 1e9)


@dataclass(frozen=True)
class ClusterConfig:
    """`num_replicas` colocated replicas, or (when both pools are given) `num_prefill_replicas`
    prefill replicas and `num_decode_replicas` decode replicas. The router picks a replica of the
    right pool for each request when it arrives."""

    num_replicas: int = 1
    router: str = "round-robin"
    num_prefill_replicas: int = 0
    num_decode_replicas: int = 0
    kv_transfer_bandwidth_gb_s: float | None = None  # None: by where the pools sit (module docstring)
    kv_transfer_latency_s: float | None = None

    def __post_init__(self) -> None:
        from policies.routers import ROUTERS

        _require(self.router in ROUTERS or ":" in self.router,
                 f"unknown router {self.router!r}; choose one of {', '.join(ROUTERS)} or give path/file.py:ClassName")
        _require(self.num_replicas >= 1, f"--replicas must be at least 1, got {self.num_replicas}")
        p, d = self.num_prefill_replicas, self.num_decode_replicas
        _require(p >= 0 and d >= 0, f"--prefill-replicas and --decode-replicas must be at least 0, got {p} and {d}")
        _require((p == 0) == (d == 0), f"disaggregation needs both pools: got --prefill-replicas {p} "
                                       f"and --decode-replicas {d}")
        _require(not (p and self.num_replicas > 1),
                 f"--replicas {self.num_replicas} is for colocated replicas; with --prefill-replicas and "
                 "--decode-replicas leave it out")
        if not p:
            _require(self.kv_transfer_bandwidth_gb_s is None and self.kv_transfer_latency_s is None,
                     "--kv-transfer-bandwidth and --kv-transfer-latency apply only with --prefill-replicas "
                     "and --decode-replicas")
        _ = self.kv_link  # KVLink checks its figures

    @property
    def is_disaggregated(self) -> bool:
        return self.num_prefill_replicas > 0

    @property
    def total_replicas(self) -> int:
        return self.num_prefill_replicas + self.num_decode_replicas if self.is_disaggregated else self.num_replicas

    @property
    def is_single(self) -> bool:
        """One colocated replica: exactly a single engine."""
        return not self.is_disaggregated and self.num_replicas == 1

    @property
    def kv_link(self) -> KVLink:
        inside_a_node = self.total_replicas <= GPUS_PER_NODE
        bandwidth = NVLINK_BANDWIDTH_GB_S if inside_a_node else RDMA_BANDWIDTH_GB_S
        latency = NVLINK_LATENCY_S if inside_a_node else RDMA_LATENCY_S
        if self.kv_transfer_bandwidth_gb_s is not None:
            bandwidth = self.kv_transfer_bandwidth_gb_s
        if self.kv_transfer_latency_s is not None:
            latency = self.kv_transfer_latency_s
        return KVLink(bandwidth, latency)
