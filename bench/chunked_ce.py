"""loss=chunked_ce against loss=cross_entropy on Hugging Face GPT-2 from its config, with GPT-2's
50,257-token vocabulary at 512 tokens, batch 8 (4,096 tokens a step), 2 layers at width 256 so
that a step takes seconds on a CPU; random weights, on CPU.

For each: the peak (the meter's, two training steps), and at the peak the loss's own category
and the activations; the loss-related bytes are the loss category plus the activations that the
chunked run does not hold (the logits, which the model's head makes whole for cross_entropy).
Then the largest relative gradient error of any parameter (|g - g_ref| / |g_ref|, dropout off),
the step-time ratio (interleaved steps, medians), and `memexp estimate` against a measured run.

    python bench/chunked_ce.py [--rounds 3] [--chunk-tokens 256]
"""

from __future__ import annotations

import argparse
import warnings

import techniques
from machine import describe_machine
from techniques import MIB, Row, correctness_run, memory_of, step_times

from memexp.estimate import estimate
from memexp.first_steps import first_steps
from memexp.loggers import NoLogger
from memexp.trainer import Trainer

MODEL = "hf-gpt2-50k"
techniques.MODELS[MODEL] = (
    "model=hf", "model.arch=gpt2", "model.task=causal_lm", "+model.config.n_layer=2",
    "+model.config.n_embd=256", "+model.config.n_head=4", "+model.config.n_positions=512",
    "data.seq_len=512", "data.batch_size=8", "data.num_train=64", "data.num_eval=16",
    "optim=sgd")
NO_DROPOUT = ("+model.config.resid_pdrop=0", "+model.config.embd_pdrop=0",
              "+model.config.attn_pdrop=0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(describe_machine())
    rows = [Row("cross_entropy", ("loss=cross_entropy",)),
            Row("chunked_ce", ("loss=chunked_ce", f"loss.chunk_tokens={args.chunk_tokens}"))]
    memory = {row.name: memory_of(MODEL, row) for row in rows}
    at_peak = {name: m["phases"][m["peak_phase"]]["breakdown"] for name, m in memory.items()}
    kept = at_peak["chunked_ce"]["activations"]
    related = {name: b["loss"] + b["activations"] - kept for name, b in at_peak.items()}
    print(f"\n| {MODEL} | peak MiB | peak phase | at the peak: loss MiB | activations MiB | "
          "loss-related MiB |\n|---|---:|---|---:|---:|---:|")
    for name, m in memory.items():
        print(f"| {name} | {m['peak_bytes'] / MIB:.1f} | {m['peak_phase']} | "
              f"{at_peak[name]['loss'] / MIB:.1f} | {at_peak[name]['activations'] / MIB:.1f} | "
              f"{related[name] / MIB:.1f} |")
    whole, chunked = (memory[row.name] for row in rows)
    print(f"\npeak: {whole['peak_bytes']:,} -> {chunked['peak_bytes']:,} bytes "
          f"({whole['peak_bytes'] / chunked['peak_bytes']:.2f}x less); loss category at the "
          f"peak: {at_peak['cross_entropy']['loss']:,} -> {at_peak['chunked_ce']['loss']:,} "
          f"bytes ({at_peak['cross_entropy']['loss'] / at_peak['chunked_ce']['loss']:.1f}x "
          f"less); loss-related: {related['cross_entropy']:,} -> {related['chunked_ce']:,} "
          f"bytes ({related['cross_entropy'] / related['chunked_ce']:.1f}x less)")

    # Gradients parameter by parameter (GPT-2's head is tied to its token embedding).
    trainers, grads, losses = {}, {}, {}
    for row in rows:
        trainer = Trainer(techniques.compose_row(MODEL, row, "memory.track=false", *NO_DROPOUT))
        trainer.model.train()
        params = list(trainer.model.parameters())
        captured = {}
        for index, param in enumerate(params):
            param.register_post_accumulate_grad_hook(
                lambda p, index=index, captured=captured: captured.__setitem__(
                    index, p.grad.detach().clone()))
        losses[row.name] = trainer.train_step(trainer.data.train_batches())
        names = [name for name, _ in trainer.model.named_parameters()]
        grads[row.name] = dict(zip(names, (captured[i] for i in range(len(params))),
                                   strict=True))
        trainers[row.name] = trainer
    errors = {name: techniques.gradient_error(grads["chunked_ce"][name],
                                              grads["cross_entropy"][name])
              for name in grads["cross_entropy"]}
    worst = max(errors, key=errors.get)
    together = techniques.gradient_error(*(correctness_run(MODEL, row, *NO_DROPOUT)[0]
                                           for row in reversed(rows)))
    relative = abs(losses["chunked_ce"] - losses["cross_entropy"]) / losses["cross_entropy"]
    print(f"\nloss {losses['cross_entropy']:.7f} vs {losses['chunked_ce']:.7f} (relative "
          f"{relative:.1e}); largest relative gradient error {errors[worst]:.1e} ({worst}); "
          f"over all gradients together {together:.1e}")
    del trainers

    times = step_times(MODEL, rows, args.rounds)
    print(f"step time: chunked_ce / cross_entropy = "
          f"{times['chunked_ce'] / times['cross_entropy']:.2f} (medians of {args.rounds}; "
          f"cross_entropy {times['cross_entropy']:.2f} s)")

    cfg = first_steps(techniques.compose_row(MODEL, rows[1]))
    predicted = estimate(cfg).memory["peak_bytes"]
    trainer = Trainer(cfg)
    trainer.fit(NoLogger())
    real = trainer.meter.report()["peak_bytes"]
    print(f"memexp estimate, chunked_ce: {predicted / MIB:.2f} MiB against {real / MIB:.2f} MiB "
          f"measured (two steps and an evaluation): {predicted / real:.4f}")
    print(f"\noverrides: {' '.join(techniques.MODELS[MODEL])}")


if __name__ == "__main__":
    main()
