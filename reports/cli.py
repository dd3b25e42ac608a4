"""`sim report DIR`: the HTML report of a run, a folder of runs, a sweep or a capacity search."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("report", help="write DIR/report.html for a run, a folder of runs, a sweep or a capacity search",
                       description="Write a self-contained HTML report (plotly inline, opens offline) for what DIR "
                                   "holds: a sweep (results.parquet), a capacity search (capacity.csv), one run "
                                   "(summary.json), or a folder of run folders (compared).")
    p.add_argument("dir", metavar="DIR", help="the folder to report on")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from reports.html import write_report

    print(f"wrote {write_report(args.dir)}")
    return 0
