"""The `memexp` command: tools around runs (training itself is `python train.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memexp.result import summary


def show(args: argparse.Namespace) -> int:
    path = Path(args.run)
    result_file = path / "result.json" if path.is_dir() else path
    if not result_file.is_file():
        print(f"memexp show: no result.json at {result_file}", file=sys.stderr)
        return 2
    result = json.loads(result_file.read_text())
    print(summary(result, result_file.parent))
    return 0 if result["status"] == "ok" else 1


def report(args: argparse.Namespace) -> int:
    from memexp.report import describe, job_folders, write_report

    sweep = Path(args.sweep)
    if not job_folders(sweep):
        print(f"memexp report: no <job>/result.json under {sweep}", file=sys.stderr)
        return 2
    try:
        print(describe(write_report(sweep, args.budget)))
    except ValueError as error:  # a budget that is not a size
        print(f"memexp report: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memexp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    show_parser = commands.add_parser("show", help="print a run's summary from its result.json")
    show_parser.add_argument("run", help="a run folder, or its result.json")
    show_parser.set_defaults(handler=show)
    report_parser = commands.add_parser(
        "report", help="write a sweep's comparison report (also of a partial or running sweep)")
    report_parser.add_argument("sweep", help="the sweep folder (outputs/sweeps/<time>)")
    report_parser.add_argument("--budget", help="a device size such as 12GiB: name the fastest "
                               "and the most accurate configs that fit")
    report_parser.set_defaults(handler=report)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
