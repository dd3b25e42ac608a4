"""The options of one run, as the user gave them (checked as values, not yet resolved)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.config import SLO, CacheConfig, SchedulerConfig
from sim.errors import ServesimError

BACKENDS = ("costmodel", "real")


@dataclass(frozen=True)
class ReplayOptions:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    model: str = "Llama-3.1-8B"
    hardware: str = "H100-SXM"
    backend: str = "costmodel"
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    device: str = "cpu"  # the real backend's device: cpu or cuda
    weights: str | None = None  # the real backend's safetensors folder; None: random weights
    profile: str | None = None  # a calibrated cost-model profile (sim calibrate); None: datasheet roofline

    def __post_init__(self) -> None:
        """Checks of the values alone; what they name (model, hardware, policy, profile) is looked
        up, once, by sim.app.plan.resolve."""
        if self.seed < 0:
            raise ServesimError(f"--seed must not be negative, got {self.seed}")
        if self.backend not in BACKENDS:
            raise ServesimError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.device not in ("cpu", "cuda"):
            raise ServesimError(f"unknown device {self.device!r}; choose cpu or cuda")
        if self.weights is not None and self.backend != "real":
            raise ServesimError(f"--weights loads the real backend's model; it does not apply to --backend {self.backend}")
        if self.profile is not None and self.backend != "costmodel":
            raise ServesimError(f"--profile calibrates the cost model; it does not apply to --backend {self.backend}")
