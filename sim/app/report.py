"""`sim report DIR`: the HTML report of a run, a folder of runs, a sweep or a capacity search,
written whole (sim.app.outputs) after the folder is checked."""

from __future__ import annotations

import argparse
from pathlib import Path

from sim.app.outputs import atomic_write_text, check_folder_destination
from sim.errors import ServesimError


def write_report(directory: str | Path) -> Path:
    """DIR/report.html for what DIR holds (reports.html draws it)."""
    from reports.html import folder_report_html

    d = Path(directory)
    if not d.is_dir():
        raise ServesimError(f"{d}: no such folder")
    check_folder_destination(d)  # a read-only folder is named before the report is drawn
    out = d / "report.html"
    atomic_write_text(out, folder_report_html(d))
    return out


def register(sub) -> None:
    p = sub.add_parser("report", help="write DIR/report.html for a run, a folder of runs, a sweep or a capacity search",
                       description="Write a self-contained HTML report (plotly inline, opens offline) for what DIR "
                                   "holds: a sweep (results.parquet), a capacity search (capacity.csv), one run "
                                   "(summary.json), or a folder of run folders (compared).")
    p.add_argument("dir", metavar="DIR", help="the folder to report on")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    print(f"wrote {write_report(args.dir)}")
    return 0
