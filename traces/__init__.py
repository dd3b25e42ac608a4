"""Traces: readers for the public formats, workload transforms, synthetic workloads, bundled samples."""

from pathlib import Path

from traces.readers import FORMATS, read_trace
from traces.trace import Trace

SAMPLES = Path(__file__).parent / "samples"
AZURE_CONV_SAMPLE = SAMPLES / "azure_conv_2023_first5min.csv"
MOONCAKE_SAMPLE = SAMPLES / "mooncake_synthetic_last200.jsonl"

__all__ = ["AZURE_CONV_SAMPLE", "FORMATS", "MOONCAKE_SAMPLE", "SAMPLES", "Trace", "read_trace"]
