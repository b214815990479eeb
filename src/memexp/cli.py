"""The `memexp` command: tools around runs (training itself is `python train.py`).

Each subcommand imports the modules it runs where it runs: `memexp show` and `memexp report`
then start without the schemas, the estimator and every technique they import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from memexp import import_from_working_directory
from memexp.errors import BAD_INPUT, reader_left
from memexp.errors import describe as describe_error
from memexp.gpus import GPUS, gpu
from memexp.result import RECORD, BadRecord, load_record, mib, printable, summary


def show(args: argparse.Namespace) -> int:
    path = Path(args.run)
    result_file = path / RECORD if path.is_dir() else path
    if not os.path.lexists(result_file):  # one that is there but no file: load_record says so
        print(f"memexp show: no {RECORD} at {printable(str(result_file))}", file=sys.stderr)
        return 2
    try:
        result = load_record(result_file)
        text = summary(result, result_file.parent)
    except BadRecord as error:
        print(f"memexp show: {error}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError, AttributeError) as error:  # a key the summary reads
        print(f"memexp show: {printable(str(result_file))}: an incomplete record "
              f"({type(error).__name__}: {printable(str(error))})", file=sys.stderr)
        return 2
    print(text)
    return 0 if result["status"] == "ok" else 1


def report(args: argparse.Namespace) -> int:
    from memexp.report import describe, job_folders, write_report

    sweep = Path(args.sweep)
    if not job_folders(sweep):
        print(f"memexp report: no <job>/{RECORD} under {printable(str(sweep))}", file=sys.stderr)
        return 2
    try:
        written = write_report(sweep, args.budget)
    except ValueError as error:  # a budget that is not a size
        print(f"memexp report: {error}", file=sys.stderr)
        return 2
    print(describe(written))
    return 1 if written.skipped else 0  # the report is written, without those records


def gpu_for(args: argparse.Namespace) -> str:
    """The GPU a CUDA estimate is for: --gpu, h100 by default; refused for a CPU estimate."""
    if args.gpu is not None and args.target != "cuda":
        raise ValueError(f"--gpu {args.gpu} is for --target cuda (this estimate is for the CPU)")
    return args.gpu or "h100"


def estimate(args: argparse.Namespace) -> int:
    from memexp.estimate import (
        attention_kernels,
        compose_config,
        describe,
        keep_freed_memory,
        optimizer_kernels,
    )
    from memexp.estimate import estimate as predict

    keep_freed_memory()
    cfg = compose_config(args.overrides)
    result = predict(cfg, target=args.target, gpu_key=gpu_for(args), world_size=args.world_size)
    if args.json:
        print(json.dumps({"memory": result.memory, "parameters": result.parameters,
                          "rank": result.rank, "world_size": result.world_size,
                          "flops_per_step": result.flops, "seconds": result.seconds,
                          "target": result.target, "trace": result.trace, "gpu": result.gpu,
                          "torch": result.torch, "attention": attention_kernels(result),
                          "optimizer": optimizer_kernels(result),
                          "routing": result.routing,
                          "step_time": (None if result.step_time is None
                                        else result.step_time.as_dict())},
                         indent=2))
    else:
        print(describe(cfg, result))
    return 0


def find_batch(args: argparse.Namespace) -> int:
    from memexp.estimate import compose_config
    from memexp.find_batch import find_batch_size

    search = find_batch_size(compose_config(args.overrides),
                             show=lambda line: print(line, flush=True))
    print(f"memexp find-batch: data.batch_size={search.batch_size} is the largest that fits in "
          f"{search.limit}")
    return 0


def world_sizes(given: str) -> tuple[int, ...]:
    """--world-size 8, or 2,4,8 (the smallest that fits): each a number of ranks >= 1."""
    try:
        sizes = tuple(int(size) for size in given.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--world-size {given}: expected a number of ranks >= 1, or several "
                         "separated by commas (2,4,8: the smallest that fits)")
    return sizes


def plan(args: argparse.Namespace) -> int:
    from memexp import plan as planner
    from memexp.estimate import keep_freed_memory

    keep_freed_memory()  # before the workers fork: theirs too

    budgets = [a.split("=", 1)[1] for a in args.arguments if a.startswith("budget=")]
    ranks = world_sizes(args.world_size)
    if not budgets and args.target == "cuda":
        # The GPU's capacity: what its memory leaves torch's allocator beside the context, and
        # beside NCCL's buffers where a plan may be a rank of several (one budget for every
        # world size searched: a plan of one process gets the smaller one too).
        device = gpu(gpu_for(args))
        outside = device.context.nbytes + (device.nccl_buffers.nbytes if max(ranks) > 1 else 0)
        budgets = [f"{(device.memory - outside) // 2**20}MiB"]
    if len(budgets) != 1:
        raise ValueError("memexp plan needs one budget=<size>, such as budget=24GiB "
                         "(with --target cuda, the --gpu's memory by default)")
    budget = budgets[0]
    arguments = [a for a in args.arguments if not a.startswith("budget=")]
    plans = planner.plan(arguments, budget, args.target, gpu_for(args), args.allow_changes,
                         show=lambda line: print(line, file=sys.stderr, flush=True),
                         world_sizes=ranks, headroom=args.headroom)
    if args.headroom is not None:
        budget += f" less {args.headroom} headroom ({mib(planner.fits_in(budget, args.headroom))})"
    print(planner.describe(arguments, budget, plans, args.allow_changes))
    if not plans:
        return 130  # interrupted before a candidate was settled
    print("\n" + planner.covered(plans[0].search))
    if plans[0].search.settled < plans[0].search.candidates:
        return 130  # interrupted (a Ctrl-C): what was settled is printed, nothing is verified
    if args.verify:
        print("\n" + planner.verify(arguments, [p for p in plans if p.fits][:args.verify],
                                     args.verify_steps))
    return 0 if any(p.fits for p in plans) else 1


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
    estimate_parser = commands.add_parser(
        "estimate", help="predict a run's peak memory by phase and category, allocating nothing")
    estimate_parser.add_argument("overrides", nargs="*",
                                 help="what you would give train.py: model=transformer ...")
    estimate_parser.add_argument(
        "--target", choices=("cpu", "cuda"), default="cpu",
        help="cuda: CUDA's own ops where a CUDA build is installed (make cuda-estimator), else "
             "the CPU kernels as a stand-in; the caching allocator, cuBLAS workspaces and the "
             "CUDA context are modelled")
    estimate_parser.add_argument("--gpu", choices=sorted(GPUS), metavar="GPU",
                                 help="the GPU a cuda estimate is for (default h100): "
                                      + ", ".join(GPUS))
    estimate_parser.add_argument(
        "--world-size", type=int, metavar="N",
        help="ranks of parallel=ddp|zero1|fsdp (default trainer.nproc): the peak of the rank "
             "with the most, traced alone on torch's fake process group")
    estimate_parser.add_argument("--json", action="store_true", help="print JSON")
    estimate_parser.set_defaults(handler=estimate)
    batch_parser = commands.add_parser(
        "find-batch", help="the largest data.batch_size that fits the GPU or memory.budget")
    batch_parser.add_argument("overrides", nargs="*", help="train.py overrides, with "
                              "memory.budget=<size> on CPU")
    batch_parser.set_defaults(handler=find_batch)
    plan_parser = commands.add_parser(
        "plan", help="the technique combinations that fit a budget, cheapest first")
    plan_parser.add_argument("arguments", nargs="*", help="budget=24GiB, then train.py overrides;"
                             " precision=fp32,bf16 (and checkpointing, optim, bn_mode, "
                             "optim.accumulate) narrows the search")
    plan_parser.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                             help="cuda: estimate as `memexp estimate --target cuda` does "
                                  "(fits = reserved memory)")
    plan_parser.add_argument("--gpu", choices=sorted(GPUS), metavar="GPU",
                             help="the GPU of a cuda plan (default h100); without budget=, its "
                                  "memory less the CUDA context")
    plan_parser.add_argument("--allow-changes", action="store_true",
                             help="rank the options that change what is learned (frozen "
                                  "BatchNorm statistics, pure half precision, another optimizer, "
                                  "accumulation with BatchNorm) by cost with the rest, instead "
                                  "of after every plan that keeps the math")
    plan_parser.add_argument("--world-size", default="1", metavar="N",
                             help="ranks to plan for: parallel=ddp, zero1 and fsdp are searched "
                                  "too, per rank; 2,4,8 plans for the smallest that fits")
    plan_parser.add_argument("--headroom", metavar="SHARE",
                             help="plan below the budget by this much: a share of it (10%% or "
                                  "0.1) or a size (2GiB), where a card's usable memory is below "
                                  "its nominal size")
    plan_parser.add_argument("--verify", type=int, default=0, metavar="K",
                             help="run the K cheapest plans for real and compare")
    plan_parser.add_argument("--verify-steps", type=int, default=5,
                             help="steps of each verification run")
    plan_parser.set_defaults(handler=plan)
    import_from_working_directory()
    try:
        # Overrides and flags in any order: what follows a flag's value is the command's
        # overrides still (`plan budget=80GB --world-size 8 precision=bf16`).
        args, rest = parser.parse_known_args(argv)
        overrides = "overrides" if "overrides" in args else "arguments"
        flags = [token for token in rest if token.startswith("-")]
        if flags or rest and overrides not in args:
            parser.error(f"unrecognized arguments: {' '.join(flags or rest)}")
        if rest:
            setattr(args, overrides, [*getattr(args, overrides), *rest])
        try:
            return args.handler(args)
        except BAD_INPUT as error:  # named by the check that failed, with the valid choices
            print(f"memexp {args.command}: {describe_error(error)}", file=sys.stderr)
            return 2
    except BrokenPipeError:
        reader_left()


if __name__ == "__main__":
    sys.exit(main())
