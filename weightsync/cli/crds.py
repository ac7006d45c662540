"""Generate the CRD manifests (crds/ and the chart's copy) and the job config's schema and reference page
(docs/job-config.schema.json, docs/job-config.md) from weightsync.resources.

With --check nothing is written: the command exits 1 and names the stale files
when a committed copy differs from what the models produce (CI runs this).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", type=Path, default=Path("."), help="repository root to write under")
    parser.add_argument("--check", action="store_true", help="only report stale files; exit 1 if any")


def run(args: argparse.Namespace) -> int:
    from weightsync.resources import crds

    if args.check:
        stale = crds.stale(args.repo)
        for path in stale:
            print(f"stale: {path} (run `weightsync crds`)")
        return 1 if stale else 0
    for path in crds.write(args.repo):
        print(f"wrote {path}")
    return 0
