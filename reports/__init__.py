"""Metrics, summary tables and reports of a run."""
