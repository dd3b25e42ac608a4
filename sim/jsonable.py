"""Plain JSON values from numpy, pandas and path values (NaN becomes null)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def jsonable(value):
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if np.isnan(value) else float(value)
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "isoformat"):  # datetimes, pandas timestamps
        return value.isoformat()
    return value
