"""torch.compile's own memory effect, and its activation memory budget's curve, on CPU.

Rows, for one model of bench/techniques.py's MODELS: eager (compile=none), then
compile=default with checkpointing=budget at each budget (1 is compile's own choice of what to
save: torch's default). For each row, one trainer:
- step 1 (it compiles) gives the gradients, against eager's (|g - g_eager| / |g_eager|);
- steps 2 and 3 under the meter give the peak and the saved activations: the CPU allocator's own
  count for the compiled rows (memexp.memory.profiled), the live-storage tracker for eager;
  compile-time allocations are left out of both (step 1 runs before the meter);
- step times: every row's steps interleaved round-robin (after a round untimed), compared by
  their medians.
Dropout is off (bench/techniques.py NO_DROPOUT), so that the gradients can match.

The curve is plotted to --plot (peak and saved activations against the budget, eager's and
compile's as lines); points that are not monotonic stay as measured.

    python bench/compile_budget.py [--model hf-llama] [--rounds 3] [--plot compile_budget.png]
                                   [extra overrides ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from machine import describe_machine
from techniques import MIB, MODELS, NO_DROPOUT, Row, compose_row, gradient_error

from memexp.trainer import Trainer

BUDGETS = (0.0, 0.25, 0.5, 0.75, 1.0)
EAGER = "eager (compile=none)"


def rows() -> list[Row]:
    return [Row(EAGER, ()), *(Row(f"compile=default budget={b}",
                                  ("compile=default", "checkpointing=budget",
                                   f"checkpointing.budget={b}")) for b in BUDGETS)]


def first_gradients(trainer: Trainer, batches) -> torch.Tensor:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    captured: dict[int, torch.Tensor] = {}
    hooks = [p.register_post_accumulate_grad_hook(
        lambda p, i=i: captured.__setitem__(i, p.grad.detach().clone()))
        for i, p in enumerate(params)]
    trainer.train_step(batches)
    for hook in hooks:
        hook.remove()
    return torch.cat([captured[i].flatten() for i in range(len(params))])


def measure(model: str, extra: list[str], rounds: int) -> list[dict]:
    results = []
    for row in rows():
        started = time.perf_counter()
        trainer = Trainer(compose_row(model, row, *NO_DROPOUT[model], *extra))
        trainer.model.train()
        batches = trainer.data.train_batches()
        grads = first_gradients(trainer, batches)
        with trainer.meter:
            for _ in range(2):
                trainer.train_step(batches)
        report = trainer.meter.report()
        results.append({"row": row, "trainer": trainer, "batches": batches, "grads": grads,
                        "peak": report["peak_bytes"], "peak_phase": report["peak_phase"],
                        "saved": report["saved_activations_bytes"],
                        "source": report["source"], "build_s": time.perf_counter() - started})
        print(f"  {row.name}: built, compiled and measured in {results[-1]['build_s']:.0f} s",
              flush=True)
    times: dict[str, list[float]] = {r["row"].name: [] for r in results}
    # Building a compiled row resets dynamo (memexp.techniques.compile): the earlier rows
    # compile again in this untimed round, each at its own budget.
    for r in results:
        r["trainer"].train_step(r["batches"])
    for round_ in range(rounds):
        order = results[round_ % len(results):] + results[:round_ % len(results)]
        for r in order:
            started = time.perf_counter()
            r["trainer"].train_step(r["batches"])
            times[r["row"].name].append(time.perf_counter() - started)
    for r in results:
        r["time"] = statistics.median(times[r["row"].name])
    return results


def table(model: str, results: list[dict], extra: list[str]) -> str:
    eager = results[0]
    lines = [f"| {model}: row | peak MiB | x eager | saved activations MiB | x eager"
             " | step time x eager | gradient error vs eager | measured by |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        error = "-" if r is eager else f"{gradient_error(r['grads'], eager['grads']):.1e}"
        lines.append(f"| {r['row'].name} | {r['peak'] / MIB:.1f} | {r['peak'] / eager['peak']:.2f}"
                     f" | {r['saved'] / MIB:.1f} | {r['saved'] / eager['saved']:.2f}"
                     f" | {r['time'] / eager['time']:.2f} | {error} | {r['source']} |")
    lines.append(f"\neager step time {eager['time'] * 1e3:.0f} ms (median); overrides: "
                 f"{' '.join([*MODELS[model], *NO_DROPOUT[model], *extra])}")
    return "\n".join(lines)


def plot(model: str, results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eager, compiled = results[0], results[1:]
    budgets = [float(r["row"].overrides[-1].split("=")[1]) for r in compiled]
    figure, axes = plt.subplots(figsize=(6.4, 4))
    for key, label, color in (("peak", "peak", "tab:blue"),
                              ("saved", "saved activations", "tab:orange")):
        axes.plot(budgets, [r[key] / MIB for r in compiled], "o-", color=color,
                  label=f"compiled: {label}")
        axes.axhline(eager[key] / MIB, color=color, linestyle=":",
                     label=f"eager: {label}")
    axes.set_xlabel("checkpointing.budget (torch._functorch.config.activation_memory_budget)")
    axes.set_ylabel("MiB (CPU, measured)")
    axes.set_title(f"{model}: compile=default's activation memory budget")
    axes.legend(fontsize="small")
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", choices=list(NO_DROPOUT), default="hf-llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", default=None, help="the curve's PNG (default: none)")
    parser.add_argument("extra", nargs="*", help="overrides after the model's (data.seq_len=..)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(describe_machine(), flush=True)
    results = measure(args.model, args.extra, args.rounds)
    print()
    print(table(args.model, results, args.extra))
    if args.plot:
        plot(args.model, results, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
