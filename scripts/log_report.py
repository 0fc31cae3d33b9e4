"""Append a saved `bench latency --json-out` report to the experiment log.

For reports produced on a machine without the repository's git metadata (the record then says
git_sha "unknown"): the SHA the run was made from is given here.

    python scripts/log_report.py REPORT.json --sha SHA [--exp-dir experiments]
"""

from __future__ import annotations

import argparse
import json

import specserve.bench.log as log
from specserve.bench.latency_report import write_log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("report")
    ap.add_argument("--sha", required=True)
    ap.add_argument("--exp-dir", default="experiments")
    args = ap.parse_args()
    with open(args.report) as fh:
        report = json.load(fh)
    env = dict(report["environment"], git_sha=args.sha, git_dirty=False)
    log.environment_info = lambda repo_dir=None: env  # the run's machine, not this one
    for png in write_log(report, args.exp_dir):
        print(png)


if __name__ == "__main__":
    main()
