"""`memexp estimate` against measured CPU peaks, and how long estimates of big models take.

Part 1: for each model and technique option, the estimate (two steps under fake tensors) and a
real run of the same config (three steps, the live-storage tracker), their peak bytes and
ratio. Part 2: wall time of `estimate()` for 125M, 1B and 7B-parameter GPT configs
(experiment=gpt_125m|gpt_1b|gpt_7b), each `--repeats` times, median reported. Part 3: how that
time grows with depth: the 7B config (d_model 4096) at 8, 16, 32 and 64 layers, and a 70B-sized
one (d_model 8192, 80 layers), the configs interleaved in each of `--repeats` rounds; medians of
wall and of CPU time (the estimate is single-threaded Python, so on an idle machine the two agree;
on a busy one CPU time is what the estimate itself cost), the growth per doubling, and the share
of the machine other processes took meanwhile.

    python bench/estimate.py [--repeats 3] [--model NAME] [--skip-accuracy] [--skip-scale]
                             [--skip-layers]

Targets: at most 2.2x per doubling of the layers; the 70B-sized config in under 20 s.
"""

from __future__ import annotations

import argparse
import statistics
import time

from machine import describe_machine
from techniques import MODELS as TECHNIQUE_MODELS

from memexp.estimate import compose_config, estimate
from memexp.loggers import NoLogger
from memexp.timing import MachineLoad
from memexp.trainer import Trainer

MIB = 2**20
CPU = ("trainer.device=cpu", "trainer.progress=false", "trainer.max_steps=3")
# Two eval batches are enough: each later one repeats the second's memory.
MODELS = {
    "resnet": ("model=resnet", "model.width=32", "data.batch_size=32", "data.num_eval=64"),
    "transformer": ("model=transformer", "model.n_layers=8", "data.batch_size=16",
                    "data.num_eval=32"),
    "mlp": ("model=mlp", "data.batch_size=256", "data.num_eval=512"),
    # timm's ConvNeXt and ViT as bench/techniques.py sizes them, with the options of its rows.
    **{model: (*TECHNIQUE_MODELS[model], "data.num_eval=64") for model in ("timm-convnext",
                                                                            "timm-vit")},
}
OPTIONS = [
    (),
    ("precision=amp",), ("precision=bf16",), ("precision=bf16_pure",),
    ("precision=fp16_pure", "precision.master_weights=true"),
    ("checkpointing=full",), ("checkpointing=offload",),
    ("optim=adamw",), ("optim=adafactor",), ("optim=adamw_8bit",),
    ("optim=sgd_momentum", "optim.in_backward=true"), ("optim.accumulate=4",),
    ("bn_mode=efficient_eval",), ("bn_mode=group_norm",),
]
BN_ONLY = {"bn_mode=efficient_eval", "bn_mode=group_norm"}
BLOCKS_ONLY = {"checkpointing=full", "checkpointing=offload"}  # the MLP has no model.blocks
TIMM_OPTIONS = {(), ("checkpointing=full",), ("checkpointing=offload",), ("precision=bf16",),
                ("optim.accumulate=4",)}


def accuracy(models: list[str]) -> None:
    print("| model | techniques | estimate MiB | measured MiB | estimate / measured | "
          "estimate s |")
    print("|---|---|---:|---:|---:|---:|")
    worst = 0.0
    for model in models:
        for option in OPTIONS:
            if (model != "resnet" and BN_ONLY & set(option)) or (
                    model == "mlp" and BLOCKS_ONLY & set(option)) or (
                    model.startswith("timm-") and option not in TIMM_OPTIONS):
                continue
            cfg = compose_config([*CPU, *MODELS[model], *option])
            predicted = estimate(cfg)
            trainer = Trainer(cfg)
            trainer.fit(NoLogger())
            real = trainer.meter.report()["peak_bytes"]
            ratio = predicted.memory["peak_bytes"] / real
            worst = max(worst, abs(ratio - 1))
            print(f"| {model} | {' '.join(option) or 'baseline'} | "
                  f"{predicted.memory['peak_bytes'] / MIB:.2f} | {real / MIB:.2f} | "
                  f"{ratio:.4f} | {predicted.seconds:.1f} |", flush=True)
    print(f"\nlargest deviation: {worst * 100:.2f}%")


def scale(repeats: int) -> None:
    print("| config | parameters | predicted peak (bf16 autocast, AdamW) | estimate s (median) |")
    print("|---|---:|---:|---:|")
    for name in ("gpt_125m", "gpt_1b", "gpt_7b"):
        cfg = compose_config([f"experiment={name}", "precision=bf16", "trainer.device=cpu"])
        times, result = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            result = estimate(cfg)
            times.append(time.perf_counter() - started)
        print(f"| {name} | {result.parameters / 1e6:,.0f}M | "
              f"{result.memory['peak_bytes'] / 2**30:.2f} GiB | {statistics.median(times):.1f} |",
              flush=True)


DEPTHS = {f"d4096, {n} layers": ("model.d_model=4096", f"model.n_layers={n}")
          for n in (8, 16, 32, 64)}
DEPTHS["d8192, 80 layers (70B-sized)"] = ("model.d_model=8192", "model.n_layers=80",
                                          "model.n_heads=64")


def layers(repeats: int) -> None:
    configs = {name: compose_config(["experiment=gpt_7b", "precision=bf16", "trainer.device=cpu",
                                     *overrides]) for name, overrides in DEPTHS.items()}
    estimate(compose_config(["model=mlp", "trainer.device=cpu"]))  # imports and caches warm
    wall: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    parameters: dict[str, int] = {}
    load = MachineLoad()
    load.start()
    for _ in range(repeats):
        for name, cfg in configs.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            parameters[name] = estimate(cfg).parameters
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    print(f"\nother processes' share of the machine meanwhile: "
          f"{load.others_share(load.own_cpu()):.0%}")
    print("| config (experiment=gpt_7b precision=bf16) | parameters | wall s (median) | CPU s "
          "(median) | x the previous, wall / CPU (layers doubled) |")
    print("|---|---:|---:|---:|---:|")
    previous = None
    for name in configs:
        now = statistics.median(wall[name]), statistics.median(cpu[name])
        growth = (f"{now[0] / previous[0]:.2f} / {now[1] / previous[1]:.2f}"
                  if previous and "80" not in name else "-")
        print(f"| {name} | {parameters[name] / 1e9:,.1f}B | {now[0]:.1f} | {now[1]:.1f} | "
              f"{growth} |", flush=True)
        previous = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all",
                        help="the models of the accuracy part")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--skip-layers", action="store_true")
    args = parser.parse_args()
    print(describe_machine())
    if not args.skip_accuracy:
        accuracy(list(MODELS) if args.model == "all" else [args.model])
    if not args.skip_scale:
        scale(args.repeats)
    if not args.skip_layers:
        layers(args.repeats)


if __name__ == "__main__":
    main()
