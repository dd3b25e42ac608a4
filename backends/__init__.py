"""Backends: given one `Batch`, say how long the engine step takes (the interface is sim/backend.py).

`costmodel` predicts the time from the batch's shape (`roofline`: datasheet peaks;
`calibrated`: coefficients fitted by `calibration`); `real` (torch + Triton, an optional extra)
runs the batch's seven arrays through a real model and measures it.
"""

from sim.backend import Backend, StepResult

__all__ = ["Backend", "StepResult"]
