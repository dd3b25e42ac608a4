"""Bad operator tables are refused in one line naming the file, the row, the column and the value.

Each test writes the small synthetic tables of tests/optables_fixture.py (flat files) or copies the
small layout of tests/data/aic_layout to tmp_path, spoils one thing, and loads them.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from backends.costmodel.optables.derive import derive
from backends.costmodel.optables.tables import load_tables
from sim.app.cli import main
from sim.errors import ServesimError
from tests.optables_fixture import TINY, write_tables

LAYOUT = Path(__file__).parent / "data" / "aic_layout"
PREFIX = "tiny_gpu__vllm-0.24.0__"
NVLINK = 450e9


def spoil(folder: Path, kind: str, column: str, value, row: int = 3, fmt: str = "csv") -> Path:
    """Flat tables in `folder` with `column` of data row `row` (from 0) of the `kind` table set to `value`."""
    write_tables(folder, fmt=fmt)
    path = folder / f"{PREFIX}{kind}_perf.{fmt}"
    frame = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
    frame[column] = frame[column].astype(object)
    frame.loc[row, column] = value
    if fmt == "csv":
        frame.to_csv(path, index=False)
    else:
        frame[column] = pd.to_numeric(frame[column])  # parquet keeps numbers as numbers
        frame.to_parquet(path)
    return path


BAD_CELLS = [  # (kind, column, value, how the message shows the value)
    ("gemm", "m", -64, "-64"), ("gemm", "m", 0, "0"), ("gemm", "n", 0, "0"), ("gemm", "k", -1, "-1"),
    ("gemm", "m", 1.5, "1.5"), ("gemm", "m", "64x", "'64x'"),
    ("custom_allreduce", "message_size", -128, "-128"), ("custom_allreduce", "message_size", 0, "0"),
    ("custom_allreduce", "num_gpus", 0, "0"), ("custom_allreduce", "num_gpus", -2, "-2"),
    ("context_attention", "batch_size", 0, "0"), ("context_attention", "isl", -16, "-16"),
    ("context_attention", "num_heads", 0, "0"), ("context_attention", "num_key_value_heads", 0, "0"),
    ("context_attention", "head_dim", "64x", "'64x'"), ("context_attention", "window_size", -1, "-1"),
    ("generation_attention", "batch_size", -1, "-1"), ("generation_attention", "step", -1, "-1"),
    ("generation_attention", "isl", 0, "0"),
]


@pytest.mark.parametrize(("kind", "column", "value", "shown"), BAD_CELLS)
def test_a_size_that_is_not_a_whole_number_of_at_least_its_least_is_refused(tmp_path, kind, column, value, shown):
    path = spoil(tmp_path, kind, column, value)
    least = 0 if column in ("step", "window_size") else 1
    message = f"{path}: row 4 (line 5), column {column}: {shown} is not a whole number of at least {least}"
    with pytest.raises(ServesimError) as e:
        load_tables(tmp_path, "tiny_gpu")
    assert str(e.value) == message


@pytest.mark.parametrize(("value", "shown"), [(-1.0, "-1.0"), (0.0, "0.0"), (math.nan, "nan"), (math.inf, "inf"),
                                              ("fast", "'fast'")])
@pytest.mark.parametrize("kind", ["gemm", "context_attention", "generation_attention", "custom_allreduce"])
def test_a_latency_that_is_not_a_positive_time_is_refused(tmp_path, kind, value, shown):
    path = spoil(tmp_path, kind, "latency", value)
    with pytest.raises(ServesimError) as e:
        load_tables(tmp_path, "tiny_gpu")
    assert str(e.value) == f"{path}: row 4 (line 5), column latency: {shown} is not a positive time (ms)"


@pytest.mark.parametrize(("column", "value"), [("m", -64), ("latency", -1.0), ("latency", math.nan)])
def test_parquet_rows_are_named_too(tmp_path, column, value):
    path = spoil(tmp_path, "gemm", column, value, fmt="parquet")
    with pytest.raises(ServesimError, match=rf"^{path}: row 4, column {column}: "):
        load_tables(tmp_path, "tiny_gpu")


def test_an_empty_kernel_name_is_refused(tmp_path):
    path = spoil(tmp_path, "context_attention", "kernel_source", None)
    with pytest.raises(ServesimError, match=rf"^{path}: row 4 \(line 5\), column kernel_source: empty$"):
        load_tables(tmp_path, "tiny_gpu")


def test_sizes_written_as_decimals_are_read_as_whole_numbers(tmp_path):
    write_tables(tmp_path)
    path = tmp_path / f"{PREFIX}gemm_perf.csv"
    frame = pd.read_csv(path)
    frame.assign(m=frame["m"].astype(float)).to_csv(path, index=False)  # 64.0 for 64
    tables = load_tables(tmp_path, "tiny_gpu")
    assert tables.gemm["m"].dtype == np.int64


def test_the_cli_refuses_a_negative_message_size_in_one_line(tmp_path, capsys):
    (tmp_path / "ops").mkdir()
    path = spoil(tmp_path / "ops", "custom_allreduce", "message_size", -128)
    model = tmp_path / "toy.json"
    model.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                                 "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096}))
    code = main(["calibrate", "--from-ops", str(tmp_path / "ops"), "--system", "tiny_gpu", "--model", str(model),
                 "--tp", "2", "--hardware", "H100-SXM", "--out", str(tmp_path / "p.json"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "p.json").exists()
    assert err.strip().splitlines() == [f"sim: error: {path}: row 4 (line 5), column message_size: -128 is not a "
                                        f"whole number of at least 1"]


# -- repeated grid points ------------------------------------------------------------------------------


def repeat_rows(folder: Path, factor: float, fmt: str = "csv") -> Path:
    """Flat tables whose bf16 m = 64 GEMM rows are appended again with their latency times `factor`."""
    write_tables(folder, fmt=fmt)
    path = folder / f"{PREFIX}gemm_perf.{fmt}"
    frame = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
    again = frame[(frame["gemm_dtype"] == "bfloat16") & (frame["m"] == 64)]
    both = pd.concat([frame, again.assign(latency=again["latency"] * factor)], ignore_index=True)
    both.to_csv(path, index=False) if fmt == "csv" else both.to_parquet(path)
    return path


@pytest.mark.parametrize(("factor", "fmt"), [(1000.0, "csv"), (1000.0, "parquet"), (1e-3, "csv"), (11.0, "csv")])
def test_repeated_points_that_disagree_are_refused(tmp_path, factor, fmt):
    path = repeat_rows(tmp_path, factor, fmt)
    with pytest.raises(ServesimError) as e:
        load_tables(tmp_path, "tiny_gpu")
    message = str(e.value)
    assert message.startswith(f"{path}: row ") and "\n" not in message
    # The point's key, less the device (the same on every row of a table).
    assert "measure the same point (kernel_source='torch.nn.functional.linear', gemm_dtype='bfloat16', m=64, n=64, " \
           "k=64) with" in message
    low = 0.002 + 64**3 * 1e-9
    # The two rows' latencies in the rows' order: the table's own first, then the one appended.
    assert f"latencies {low:g} and {low * factor:g} ms, more than 10x apart" in message


@pytest.mark.parametrize("factor", [1.0, 1.3])
def test_repeated_points_that_agree_are_measurements_averaged_as_before(tmp_path, factor):
    repeat_rows(tmp_path, factor)
    tables = load_tables(tmp_path, "tiny_gpu")
    d = derive(tables, TINY)
    clean = tmp_path / "clean"
    clean.mkdir()
    write_tables(clean)
    base = derive(load_tables(clean, "tiny_gpu"), TINY)
    if factor == 1.0:  # the same rows again change nothing
        assert d["gemm"] == base["gemm"]
    else:  # repeats within the noise of the published tables are averaged, as the derivation always did
        assert d["gemm"] != base["gemm"]


# -- empty tables, two files for one table ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_an_empty_table_is_refused(tmp_path, fmt):
    write_tables(tmp_path, fmt=fmt)
    path = tmp_path / f"{PREFIX}gemm_perf.{fmt}"
    frame = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
    frame.iloc[:0].to_csv(path, index=False) if fmt == "csv" else frame.iloc[:0].to_parquet(path)  # a header only
    with pytest.raises(ServesimError, match=rf"^{path}: the gemm table has no rows$"):
        load_tables(tmp_path, "tiny_gpu")


def test_a_flat_table_in_two_files_is_refused(tmp_path):
    write_tables(tmp_path)
    csv = tmp_path / f"{PREFIX}gemm_perf.csv"
    pd.read_csv(csv).to_parquet(csv.with_suffix(".parquet"))
    with pytest.raises(ServesimError, match=rf"^{csv} and {PREFIX}gemm_perf.parquet: one table in two files; keep one$"):
        load_tables(tmp_path, "tiny_gpu")
    other = tmp_path / "other"  # another system's clash does not stop this one
    other.mkdir()
    write_tables(other)
    write_tables(other, system="b_gpu")
    pd.read_csv(other / "b_gpu__vllm-0.24.0__gemm_perf.csv").to_parquet(other / "b_gpu__vllm-0.24.0__gemm_perf.parquet")
    assert load_tables(other, "tiny_gpu").system == "tiny_gpu"


# -- the package's layout ----------------------------------------------------------------------------------


@pytest.fixture
def layout(tmp_path) -> Path:
    pytest.importorskip("yaml")
    copy = tmp_path / "aic"
    shutil.copytree(LAYOUT, copy)
    return copy


VERSION = Path("systems", "data", "tiny_gpu", "attention", "vllm", "0.22.0")


@pytest.mark.parametrize(("text", "message"), [
    (b"just a string\n", "not a reuse file: expected a mapping with a list `reuse` of entries"),
    (b"- table: generation_attention_perf\n", "not a reuse file: expected a mapping with a list `reuse` of entries"),
    (b"reuse: generation_attention_perf\n", "not a reuse file: expected a mapping with a list `reuse` of entries"),
    (b"reuse:\n- generation_attention_perf\n", "each reuse entry needs table and from_version"),
    (b"reuse:\n- table: generation_attention_perf\n  from_version: ../../vllm/0.20.0\n",
     "from_version '../../vllm/0.20.0' is not a version folder's name"),
    (b"\xff\xfer\x00e\x00", "cannot read it: 'utf-8' codec can't decode byte 0xff"),
    (b"reuse: [\n", "cannot read it: while parsing"),
])
def test_a_bad_reuse_yaml_is_refused_naming_it(layout, text, message):
    path = layout / VERSION / "reuse.yaml"
    path.write_bytes(text)
    with pytest.raises(ServesimError) as e:
        load_tables(layout, "tiny_gpu")
    assert str(e.value).startswith(f"{path}: {message}") and "\n" not in str(e.value)


@pytest.mark.parametrize(("text", "message"), [
    (b"just a string\n", "not a reuse manifest"),
    (b"groups: [1, 2]\n", "not a reuse manifest"),
    (b"groups:\n- op_file: gemm_perf.txt\n  kernel_source: k\n  frameworks: vllm\n", "a group's frameworks must be a list"),
    (b"\xff\xfe", "cannot read it: 'utf-8' codec can't decode byte 0xff"),
])
def test_a_bad_reuse_manifest_is_refused_naming_it(layout, text, message):
    path = layout / "systems" / "perf_data_reuse_manifest.yaml"
    path.write_bytes(text)
    with pytest.raises(ServesimError, match=rf"^{path}: {message}"):
        derive(load_tables(layout, "tiny_gpu"), TINY, tp=2, nvlink_bytes_per_s=NVLINK)


def test_a_layout_table_in_two_files_is_refused(layout):
    folder = layout / "systems" / "data" / "tiny_gpu" / "gemm" / "vllm" / "0.20.0"
    pd.read_csv(folder / "gemm_perf.csv").to_parquet(folder / "gemm_perf.parquet")
    with pytest.raises(ServesimError, match=rf"^{folder / 'gemm_perf.parquet'} and gemm_perf.csv: one table in two "
                                            rf"files; keep one$"):
        load_tables(layout, "tiny_gpu")


@pytest.mark.parametrize(("table", "column", "value"), [
    (Path("gemm", "vllm", "0.20.0", "gemm_perf.csv"), "n", 0),
    (Path("comm", "vllm", "0.20.0", "custom_allreduce_perf.csv"), "message_size", -128),
    (Path("comm", "nccl", "2.27.3", "nccl_perf.csv"), "num_gpus", 0),
    (Path("comm", "nccl", "2.27.3", "nccl_perf.csv"), "latency", -0.5),
    (Path("attention", "vllm", "0.20.0", "generation_attention_perf.csv"), "head_dim", "64x"),
    (Path("mla", "vllm", "0.20.0", "mla_context_module_perf.csv"), "batch_size", 0),
])
def test_every_layout_table_is_checked(layout, table, column, value):
    path = layout / "systems" / "data" / "tiny_gpu" / table
    frame = pd.read_csv(path)
    frame[column] = frame[column].astype(object)
    frame.loc[0, column] = value
    frame.to_csv(path, index=False)
    with pytest.raises(ServesimError, match=rf"^{path}: row 1 \(line 2\), column {column}: "):
        if table.parts[0] == "mla":
            from backends.costmodel.optables.systems import read_layout_table

            read_layout_table(layout / "systems" / "data", "tiny_gpu", "mla", "vllm", path.stem, None)
        else:
            load_tables(layout, "tiny_gpu")
