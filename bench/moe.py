"""Mixture-of-experts models: `memexp estimate` against measured CPU peaks, what it assumed of
the router, and what the router measured.

Part 1: for Mixtral, Qwen2-MoE and DeepSeek-V3 (transformers 5.24, from small configs: random
weights, nothing downloaded), at fp32 and bf16 autocast, with transformers' two ways of running
the experts (`grouped_mm`, its default: one torch._grouped_mm over the tokens sorted by expert;
`eager`: a loop over experts, each taking its tokens with nonzero), and with checkpointing none,
full and selective_ops, adapter=lora (attention and MLP projections) and lora with the experts
adapted too (adapter.target_parameters=[auto]): the real run's peak (two steps and two eval
batches, the live-storage tracker), the estimate's, their error, and the estimate's routing
line, shortened: whether it assumed the router's choices, and the unbalanced case's peak where
it did; and the bytes the run saved for backward (the meter's saved_activations_bytes).
Beside it, what each router measured in the run without checkpointing (RouterCounts: the
tokens each expert got in one router call, smallest and largest over the layers, the training
and the eval batches), against the assumed share tokens x top_k / experts. Losses: whether
checkpointing's two steps gave the losses of none, to the bit.

Part 2 (`--ranks`): the same models at parallel=fsdp, `memexp estimate --world-size 2` against
the two real ranks of `python train.py trainer.nproc=2` (gloo), each rank's peak read from its
result.json.

    python bench/moe.py [--models mixtral qwen2_moe deepseek_v3] [--skip-table] [--ranks]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from machine import describe_machine
from torch.utils._python_dispatch import TorchDispatchMode

from memexp.estimate import compose_config, estimate
from memexp.estimate_moe import where_name
from memexp.loggers import NoLogger
from memexp.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
KIB = 2**10
CPU = ("trainer.device=cpu", "trainer.progress=false", "trainer.max_steps=2", "logger=none")
DATA = ("data.batch_size=8", "data.seq_len=64", "data.num_train=64", "data.num_eval=16")
SHARED = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 256, "num_experts_per_tok": 2}
CONFIGS = {
    "mixtral": {**SHARED, "intermediate_size": 128, "num_key_value_heads": 2,
                "num_local_experts": 8},
    "qwen2_moe": {**SHARED, "intermediate_size": 128, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 128, "num_key_value_heads": 2,
                  "num_experts": 8, "norm_topk_prob": "true"},
    # two groups of 4 experts, the best group picked first; a dense first layer
    "deepseek_v3": {**SHARED, "intermediate_size": 128, "moe_intermediate_size": 64,
                    "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 2,
                    "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16},
}
PRECISIONS = {"fp32": (), "bf16": ("precision=bf16",)}
EXPERTS = {"grouped_mm": (), "eager": ("+model.config.experts_implementation=eager",)}
TECHNIQUES = {
    "none": (),
    "full": ("checkpointing=full",),
    "selective_ops": ("checkpointing=selective_ops",),
    "lora": ("adapter=lora",),
    "lora + experts": ("adapter=lora", "adapter.target_parameters=[auto]"),
}


def model(name: str) -> tuple[str, ...]:
    return ("model=hf", f"model.arch={name}", "model.task=causal_lm",
            *(f"+model.config.{key}={value}" for key, value in CONFIGS[name].items()), *DATA)


class RouterCounts(TorchDispatchMode):
    """In a real run: for each topk call, by the module that runs it and its sizes, how many
    tokens each choice (expert) received."""

    def __init__(self):
        super().__init__()
        self.counts: dict[tuple, list[list[int]]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.topk.default:
            scores, indices = args[0], out[1]
            experts = scores.shape[-1]
            key = (where_name(), experts, indices.shape[-1])
            self.counts[key].append(torch.bincount(indices.flatten(), minlength=experts)
                                    .tolist())
        return out


def measure(overrides: tuple[str, ...], counts: RouterCounts | None = None):
    trainer = Trainer(compose_config(list(overrides)))
    if counts is None:
        metrics = trainer.fit(NoLogger())
    else:
        with counts:
            metrics = trainer.fit(NoLogger())
    report = trainer.meter.report()
    return report["peak_bytes"], report["saved_activations_bytes"], metrics.losses


def assumption(result) -> str:
    routing = result.routing
    if routing is None:
        return "no router"
    if not routing["decides_sizes"]:
        return "nothing assumed (no size depends on the choices)"
    change = routing["unbalanced"]["peak_bytes"] / result.memory["peak_bytes"] - 1
    return f"even spread; unbalanced {change:+.1%}"


def measured_spread(result, counts: RouterCounts) -> str:
    """Per router (as the estimate names it): the assumed share, and the smallest and largest
    number of tokens an expert got in one call of it."""
    if result.routing is None:
        return "-"
    parts = []
    for router in result.routing["routers"]:
        calls = counts.counts.get((router["where"], router["experts"], router["top_k"]), [])
        got = [n for call in calls for n in call]
        if got:
            parts.append(f"{router['top_k']} of {router['experts']}: share "
                         f"{router['tokens'] * router['top_k'] / router['experts']:g}, measured "
                         f"{min(got)}-{max(got)}")
    return "; ".join(parts)


def table(models: list[str]) -> None:
    print("| model | precision | experts | technique | saved for backward KiB | measured KiB | "
          "estimate KiB | error | "
          "estimate assumed | router, measured (tokens an expert got in one call) | "
          "losses = none's |")
    print("|---|---|---|---|---:|---:|---:|---:|---|---|---|")
    worst = 0.0
    for name in models:
        for precision, experts in ((p, e) for p in PRECISIONS for e in EXPERTS):
            counts, base_losses = RouterCounts(), None
            for technique, options in TECHNIQUES.items():
                overrides = (*CPU, *model(name), *PRECISIONS[precision], *EXPERTS[experts],
                             *options)
                peak, saved, losses = measure(overrides, counts if technique == "none" else None)
                base_losses = losses if technique == "none" else base_losses
                result = estimate(compose_config(list(overrides)))
                error = result.memory["peak_bytes"] / peak - 1
                worst = max(worst, abs(error))
                same = ("-" if technique in ("none", "lora", "lora + experts")
                        else "yes" if losses == base_losses else f"no: {losses}")
                spread = measured_spread(result, counts) if technique == "none" else ""
                print(f"| {name} | {precision} | {experts} | {technique} | {saved / KIB:,.1f} | "
                      f"{peak / KIB:,.1f} | "
                      f"{result.memory['peak_bytes'] / KIB:,.1f} | {error:+.2%} | "
                      f"{assumption(result)} | {spread} | {same} |", flush=True)
    print(f"\nlargest error: {worst:.2%}")


def real_ranks(overrides: tuple[str, ...], folder: Path) -> list[dict]:
    run_dir = Path(tempfile.mkdtemp(dir=folder))
    done = subprocess.run([sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}",
                           *overrides, "trainer.nproc=2"], capture_output=True, text=True,
                          cwd=folder, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{overrides}: {done.stderr[-3000:]}")
    return json.loads((run_dir / "result.json").read_text())["memory"]["per_rank"]


def ranks(models: list[str]) -> None:
    print("\n| model (parallel=fsdp, fp32) | estimate, rank 0 of 2, KiB | rank 0 KiB | "
          "rank 1 KiB | error against rank 0 | against the larger |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for name in models:
            overrides = (*CPU, *model(name), "parallel=fsdp")
            result = estimate(compose_config(list(overrides)), world_size=2)
            real = [rank["peak_bytes"] for rank in real_ranks(overrides, Path(folder))]
            peak = result.memory["peak_bytes"]
            print(f"| {name} | {peak / KIB:,.1f} | {real[0] / KIB:,.1f} | {real[1] / KIB:,.1f} | "
                  f"{peak / real[0] - 1:+.2%} | {peak / max(real) - 1:+.2%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--skip-table", action="store_true")
    parser.add_argument("--ranks", action="store_true", help="part 2: --world-size 2 (fsdp)")
    args = parser.parse_args()
    print(describe_machine())
    if not args.skip_table:
        table(args.models)
    if args.ranks:
        ranks(args.models)


if __name__ == "__main__":
    main()
