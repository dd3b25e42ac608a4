"""The cost models: a step's time predicted from its batch's shape, nothing run.

- `optables/` (the default): the sum of measured operator times, read from a committed profile or
  derived from the tables package's operator tables for the run's system and vLLM version.
- `roofline.py` (with `tensor_parallel.py`): datasheet peaks and efficiencies; the fallback where
  no table prices the run (`--profile roofline` asks for it), and the mixture-of-experts roofline.
- `fitted.py`: a non-negative sum of roofline terms with costs fitted to measured steps
  (`sim calibrate`; `--profile` a fitted profile).

`frame.py` is what the roofline and the fitted model share (`CostModel`, `StepAggregates`) and
`make_cost_model`, which picks between those two; sim/app/plan.py picks the operator tables first.
"""

from backends.costmodel.frame import (
    CostModel,
    StepAggregates,
    batch_aggregates,
    make_cost_model,
    run_aggregates,
    step_aggregates,
)

__all__ = ["CostModel", "StepAggregates", "batch_aggregates", "make_cost_model", "run_aggregates", "step_aggregates"]
