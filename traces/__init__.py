"""Traces: readers for the public formats, and the bundled samples."""

from pathlib import Path

from traces.readers import read_trace
from traces.trace import Trace

SAMPLES = Path(__file__).parent / "samples"
AZURE_CONV_SAMPLE = SAMPLES / "azure_conv_2023_first5min.csv"

__all__ = ["Trace", "read_trace", "SAMPLES", "AZURE_CONV_SAMPLE"]
