"""memexp's predicted step time against step times measured on a real H100.

../shared/gpu/h100-2026-11-26/plain-loop-step-times.md gives the step times of plain PyTorch
loops on one H100 80GB HBM3 (torch 2.11.0+cu130, transformers 5.17): Hugging Face models built
from config, forward, backward, optimizer step and zero_grad, the median of steps 2-4, default
torch settings (SDPA, foreach AdamW, TF32 off for matmuls, on for cuDNN's convolutions), half
the sequences padded. Each case here is the same run as memexp overrides; its prediction is
`memexp estimate <overrides> --target cuda --gpu h100` (memexp.steptime), traced in the CUDA
build (.venv-cuda), so its attention kernels, autocast op lists and foreach optimizers are
CUDA's. The error is (predicted - measured) / measured; the target is 25% for each, and for
BERT-large the measured order AMP < fp32 < checkpointing.

None of the eight set a figure of the model: the GPUs' rates are their data sheets' and
published measurements' (memexp.gpus), and the host's time per op was measured on the same H100
machine on another model (`--calibration`).

    python bench/step_time.py                 the table (about 4 minutes on 2 cores)
    python bench/step_time.py --calibration   where memexp.gpus.HOST_OP comes from
    python bench/step_time.py --convolutions  where memexp.gpus.CONV_A100 and CONV_V100 come from
    python bench/step_time.py --overhead      the share of an 8B estimate's time spent pricing
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from memexp.estimate import compose_config, estimate
from memexp.gpus import HOST_OP, HOST_TENSOR_OP, gpu
from memexp.steptime import duration

BERT_LARGE = ("model=hf", "model.arch=bert", "model.task=sequence_classification",
              "+model.config.hidden_size=1024", "+model.config.num_hidden_layers=24",
              "+model.config.num_attention_heads=16", "+model.config.intermediate_size=4096",
              "data.seq_len=512", "data.batch_size=4")
GPT2 = ("model=hf", "model.arch=gpt2", "model.task=causal_lm", "data.seq_len=1024",
        "data.batch_size=8", "precision=bf16")
IMAGENET = ("model.task=image_classification", "+model.config.num_labels=1000",
            "loss=cross_entropy", "data=images", "data.image_size=224", "data.num_classes=1000")
# (case, overrides, measured step s): plain-loop-step-times.md's rows, in its order. The loops'
# gradient checkpointing is Hugging Face's own (non-reentrant), as model.gradient_checkpointing
# switches it on.
CASES = [
    ("bert_large_bs4_fp32", BERT_LARGE, 0.1137),
    ("bert_large_bs4_amp", (*BERT_LARGE, "precision=amp"), 0.0868),
    ("bert_large_bs4_gc", (*BERT_LARGE, "model.gradient_checkpointing=true"), 0.1665),
    ("gpt2_bs8_s1024_bf16", GPT2, 0.0732),
    ("gpt2_bs8_s1024_bf16_gc", (*GPT2, "model.gradient_checkpointing=true"), 0.1020),
    ("llama_small_bs4_s1024_bf16",
     ("model=hf", "model.arch=llama", "model.task=causal_lm", "+model.config.hidden_size=1024",
      "+model.config.num_hidden_layers=16", "+model.config.intermediate_size=2816",
      "+model.config.num_attention_heads=16", "+model.config.vocab_size=32000",
      "data.seq_len=1024", "data.batch_size=4", "precision=bf16"), 0.0694),
    ("vit_base_bs32_fp32", ("model=hf", "model.arch=vit", *IMAGENET, "data.batch_size=32"),
     0.0931),
    ("resnet50_bs32_fp32_sgd", ("model=hf", "model.arch=resnet", *IMAGENET,
                                "data.batch_size=32", "optim=sgd"), 0.0216),
]
# The host's calibration (memexp.gpus.HOST_OP): experiment=checkpointing_transformer's jobs 0
# and 2 on the same H100 (bench-gpu.log), tokens per step over their throughput.
CALIBRATION = ("experiment=checkpointing_transformer", "data.batch_size=16", "checkpointing=none")
CALIBRATION_STEPS = {16: 16 * 64 / 60988.2, 64: 64 * 64 / 258769.4}
# Published ResNet-50 v1.5 training throughput on one GPU, NVIDIA's ConvNets code (its SGD with
# momentum, NCHW, no AMP): (GPU, memexp overrides, batch, images/s). The A100's and the V100's
# are NVIDIA's (DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md,
# "Training performance", pytorch-21.03 container), at the batch sizes of its configs.yml. The
# H100's is Lambda's (github.com/lambdal/deeplearning-benchmark, pytorch/results/
# 1cc_H100_80GB_SXM5_v1/PyTorch_resnet50_FP32/02-05-2024_03-57-53.txt, "Summary: ...
# train.total_ips : 1897.73 images/s", batch 640, synthetic data, 2024; its 2023 run in an older
# container, H100_80GB_SXM5_v1/.../14-02-2023_05-40-27.txt, had 1753.15): no H100 figure is
# in NVIDIA's README. Hugging Face's ResNet-50 is the same v1.5 network (the stride in the 3x3
# convolution); TF32 is torch's default for cuDNN's convolutions, fp32 on a V100.
RESNET50_PUBLISHED = [("a100-80gb", (), 256, 938.0), ("v100-16gb", (), 112, 367.0),
                      ("h100", (), 640, 1897.73)]
RESNET50 = ("model=hf", "model.arch=resnet", *IMAGENET, "optim=sgd_momentum")
LLAMA_8B = ("model=hf", "model.arch=llama", "model.task=causal_lm",
            "+model.config.hidden_size=4096", "+model.config.num_hidden_layers=32",
            "+model.config.num_attention_heads=32", "+model.config.num_key_value_heads=8",
            "+model.config.intermediate_size=14336", "+model.config.vocab_size=128256",
            "data.seq_len=2048", "data.batch_size=1")


def predict(overrides, gpu_key: str = "h100") -> tuple:
    started = time.perf_counter()
    result = estimate(compose_config(list(overrides)), target="cuda", gpu_key=gpu_key)
    if result.trace != "cuda":
        raise SystemExit("bench/step_time.py needs the CUDA build (make cuda-estimator): "
                         f"this estimate was traced on the {result.trace}")
    return result.step_time, time.perf_counter() - started


def table() -> None:
    print("| case | measured | predicted | error | GPU arithmetic | GPU memory | host | host "
          "not hidden | kernels | ops |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    predicted = {}
    for case, overrides, measured in CASES:
        step, _ = predict(overrides)
        predicted[case] = step.seconds
        parts = step.parts
        print(f"| {case} | {duration(measured)} | {duration(step.seconds)} | "
              f"{step.seconds / measured - 1:+.1%} | {duration(parts['compute_s'])} | "
              f"{duration(parts['memory_s'])} | {duration(step.host_s)} | "
              f"{duration(parts['exposed_host_s'])} | {step.kernels:,.0f} | {step.ops:,.0f} |",
              flush=True)
    errors = [abs(predicted[case] / measured - 1) for case, _, measured in CASES]
    bert = [predicted[f"bert_large_bs4_{k}"] for k in ("amp", "fp32", "gc")]
    print(f"\nlargest error {max(errors):.1%} (target 25%), median {statistics.median(errors):.1%};"
          f" BERT-large amp < fp32 < checkpointing: {bert[0] < bert[1] < bert[2]} "
          f"({', '.join(duration(s) for s in bert)})")


def calibration() -> None:
    """The host's time per op from the calibration model's measured steps and its trace."""
    step, _ = predict(CALIBRATION)
    host_ops = sum(phase.host_ops for phase in step.phases.values())
    device_ops = step.ops - host_ops
    measured = statistics.mean(CALIBRATION_STEPS.values())
    per_op = (measured - host_ops * HOST_TENSOR_OP.value) / device_ops
    steps = ", ".join(f"batch {b} {duration(s)}" for b, s in CALIBRATION_STEPS.items())
    print(f"measured steps: {steps} (mean {duration(measured)}); traced ops: "
          f"{device_ops:,.0f} on the device, "
          f"{host_ops:,.0f} on host tensors alone; host per device op: {per_op * 1e6:.1f} us "
          f"(memexp.gpus.HOST_OP: {HOST_OP.value * 1e6:.1f} us); GPU time "
          f"{duration(step.seconds - step.parts['exposed_host_s'])}")


def convolutions() -> None:
    """The share of the peak that cuDNN's convolutions reach, from a published ResNet-50 step:
    the step's time less memexp's price of its other kernels is the convolutions' time. Priced
    with the share memexp.gpus holds, the convolutions take `convolution_s`; at the share that
    fits the published step they take (published step - the rest), so the share scales by
    their ratio. Convolutions that change between compute- and memory-bound move the rest:
    memexp.gpus holds the figure once a run prints it back (converged)."""
    for key, overrides, batch, images_per_s in RESNET50_PUBLISHED:
        step, _ = predict((*RESNET50, f"data.batch_size={batch}", *overrides), key)
        published = batch / images_per_s
        convolution = sum(phase.convolution_s for phase in step.phases.values())
        rest = step.seconds - convolution
        held = gpu(key).speeds.convolution_share.value
        share = held * convolution / (published - rest)
        print(f"{key}, batch {batch}: published step {duration(published)} ({images_per_s:g} "
              f"images/s); memexp at share {held:.3f}: convolutions {duration(convolution)}, "
              f"the rest {duration(rest)} (of which the GPU waiting for the host "
              f"{duration(step.parts['exposed_host_s'])}); share that fits {share:.3f}"
              f"{' (converged)' if abs(share / held - 1) < 0.005 else ''}")


def overhead() -> None:
    """What pricing the ops costs the 8B Llama's estimate: the share of its CPU time spent in
    StepTimer.record (with what it calls), under cProfile, on the CPU stand-in (the trace in this
    process, MEMEXP_CUDA_PYTHON=none; the CUDA build's runs the same record). A share of one
    process's time, where A/B wall times on a shared machine vary by more than it. Then the CUDA
    build's estimate as it is, in wall time."""
    import cProfile
    import pstats

    cuda_python = os.environ.get("MEMEXP_CUDA_PYTHON")
    os.environ["MEMEXP_CUDA_PYTHON"] = "none"
    profile = cProfile.Profile()
    try:
        cfg = compose_config(list(LLAMA_8B))
        profile.runcall(estimate, cfg, target="cuda", gpu_key="h100")
    finally:
        if cuda_python is None:
            del os.environ["MEMEXP_CUDA_PYTHON"]
        else:
            os.environ["MEMEXP_CUDA_PYTHON"] = cuda_python
    stats = pstats.Stats(profile).stats
    total = sum(row[2] for row in stats.values())  # every function's own time
    record = next(row for key, row in stats.items()
                  if key[0].endswith("steptime.py") and key[2] == "record")
    print(f"CPU stand-in under cProfile: {record[3]:.2f} s in StepTimer.record of {total:.1f} s "
          f"({record[3] / total:.1%}), {record[1]:,} ops seen")
    print(f"CUDA build, as it is: {predict(LLAMA_8B)[1]:.1f} s wall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", action="store_true")
    parser.add_argument("--convolutions", action="store_true")
    parser.add_argument("--overhead", action="store_true")
    args = parser.parse_args()
    from machine import describe_machine  # bench/machine.py, beside this script

    print(describe_machine())
    if args.calibration:
        calibration()
    elif args.convolutions:
        convolutions()
    elif args.overhead:
        overhead()
    else:
        table()


if __name__ == "__main__":
    main()
