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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memexp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    show_parser = commands.add_parser("show", help="print a run's summary from its result.json")
    show_parser.add_argument("run", help="a run folder, or its result.json")
    show_parser.set_defaults(handler=show)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
