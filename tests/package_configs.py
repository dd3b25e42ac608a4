"""The tables package's model configs (aiconfigurator_core/model_configs/ORG--NAME_config.json), for
the tests of the families read from them. Importing this skips the importing test module where the
tables extra is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.model_config import ModelConfig

aic = pytest.importorskip("aiconfigurator_core")
CONFIGS = Path(aic.__file__).parent / "model_configs"


def package(name: str) -> ModelConfig:
    """The package's config `name` (ORG--NAME) as servesim reads it."""
    return ModelConfig.from_hf(CONFIGS / f"{name}_config.json")


def raw(name: str) -> dict:
    """The package's config `name` as its JSON object."""
    return json.loads((CONFIGS / f"{name}_config.json").read_text())


def write(tmp_path: Path, config: dict) -> Path:
    """`config` written as tmp_path/m/config.json (again on each call); the folder."""
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder
