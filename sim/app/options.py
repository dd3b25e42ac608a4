"""The options of one run, as the user gave them (checked as values, not yet resolved)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.app.cluster_options import ClusterOptions
from sim.config import SLO, CacheConfig, SchedulerConfig
from sim.errors import ServesimError

BACKENDS = ("costmodel", "real")


@dataclass(frozen=True)
class ReplayOptions:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    model: str = "Llama-3.1-8B"  # a preset's name, or a config.json (or a folder holding one)
    hardware: str = "H100-SXM"  # a preset's name, or a hardware JSON file
    tp: int = 1  # tensor parallelism: GPUs per engine
    dtype: str = "bf16"  # of the weights: bf16 or fp8
    kv_cache_dtype: str = "auto"  # auto (the activations' bf16) or fp8
    backend: str = "costmodel"
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    device: str = "cpu"  # the real backend's device: cpu or cuda
    weights: str | None = None  # the real backend's safetensors folder; None: random weights
    # A cost-model profile (sim calibrate: fitted, or --from-ops operator tables); "roofline": the
    # datasheet roofline; None: the committed operator-table profile matching the run, else the roofline.
    profile: str | None = None
    cluster: ClusterOptions = field(default_factory=ClusterOptions)  # one replica by default
    # The vLLM version whose operator tables price the run (AIConfigurator's package, the tables
    # extra): that version, else the nearest the system has; None: the newest (sim/app/opprofiles.py).
    vllm_version: str | None = None

    def __post_init__(self) -> None:
        """Checks of the values alone; what they name (model, hardware, policy, profile) is looked
        up, once, by sim.app.plan.resolve."""
        if self.seed < 0:
            raise ServesimError(f"--seed must not be negative, got {self.seed}")
        if not (isinstance(self.tp, int) and self.tp >= 1):
            raise ServesimError(f"--tp must be a whole number >= 1, got {self.tp}")
        if self.dtype not in ("bf16", "fp8", "fp4"):  # fp4 (nvfp4): operator tables only (sim/app/plan.py)
            raise ServesimError(f"unknown --dtype {self.dtype!r}; choose bf16 or fp8")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ServesimError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose auto or fp8")
        deployment = (self.tp, self.dtype, self.kv_cache_dtype) != (1, "bf16", "auto")
        if deployment and self.backend == "real":  # a fitted profile's limits are checked by sim.app.plan
            raise ServesimError("--tp, --dtype fp8 and --kv-cache-dtype fp8 are priced by the cost model; the real "
                                "backend runs one device in its own dtype")
        if self.backend not in BACKENDS:
            raise ServesimError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.device not in ("cpu", "cuda"):
            raise ServesimError(f"unknown device {self.device!r}; choose cpu or cuda")
        if self.device != "cpu" and self.backend != "real":
            raise ServesimError(f"--device {self.device} is the real backend's; it does not apply to --backend "
                                f"{self.backend} (whose hardware is --hardware)")
        if self.weights is not None and self.backend != "real":
            raise ServesimError(f"--weights loads the real backend's model; it does not apply to --backend {self.backend}")
        if self.backend == "real" and not self.cluster.is_single:
            raise ServesimError("a cluster replays with the cost model; --backend real runs one engine")
        if self.vllm_version is not None and self.backend != "costmodel":
            raise ServesimError("--vllm-version picks the operator tables the cost model is priced from; it does not "
                                f"apply to --backend {self.backend}")
        if self.profile is not None and self.backend != "costmodel":
            raise ServesimError(f"--profile calibrates the cost model; it does not apply to --backend {self.backend}")
