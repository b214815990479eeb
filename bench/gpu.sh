#!/usr/bin/env bash
# The GPU checks that BENCHMARKS.md names, in one command, for a machine with a CUDA GPU (about
# 4 minutes on an H200, and up to 4 more for bench/offload_float8.py). The python it runs needs
# a CUDA build of torch and memexp's dependencies (`pip install -e .` or PYTHONPATH).
#
#   bash bench/gpu.sh OUTDIR        (PYTHON=... to pick the interpreter; default python3)
#
# It writes OUTDIR/gpu.log (every command's output, the sweeps' reports included) and
# OUTDIR/sweeps.tgz (each sweep's report.md and each job's result.json). Each check runs under
# its own time limit, and a failed one does not stop the others: its exit status is logged.
set -u
out=${1:?usage: bash bench/gpu.sh OUTDIR}
py=${PYTHON:-python3}
sweeps=$(mktemp -d)
log=$out/gpu.log
mkdir -p "$out"
: >"$log"

check() {  # check NAME SECONDS COMMAND...: one check, its output and exit status into the log
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*" >>"$log"
    local started=$SECONDS
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - started)) s" >>"$log"
}

sweep() {  # sweep NAME SECONDS OVERRIDES...: a CUDA sweep into its own folder, then its report
    local name=$1 limit=$2
    shift 2
    check "$name" "$limit" "$py" train.py -m trainer.device=cuda trainer.progress=false "$@" \
        "hydra.sweep.dir=$sweeps/$name"
    cat "$sweeps/$name/report.md" >>"$log" 2>/dev/null
}

check machine 30 "$py" -c "import sys; sys.path.insert(0, 'bench'); from machine import \
describe_machine; print(describe_machine())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$log" 2>&1

# The tests that need CUDA (marked cuda): the estimate against max_memory_allocated, the
# allocator's snapshot, AMP's lower peak, a baseline timed beside a CUDA run.
check tests 150 "$py" -m pytest -q -p no:cacheprovider -m cuda tests/test_estimate.py \
    tests/test_memory_tools.py tests/test_precision.py tests/test_timing.py tests/test_optim.py

# Issue 41: optim.offload=cpu, checkpointing=full_offload and precision=float8 run for real,
# each against its estimate for this GPU (GPU_KEY: memexp.gpus' key; float8's rows fail, saying
# why, below compute capability 8.9).
check offload_float8 240 "$py" bench/offload_float8.py --gpu "${GPU_KEY:-h200}"

# Activation checkpointing on the 8-layer transformer: peak allocated and time.
sweep checkpointing_transformer 120 experiment=checkpointing_transformer

# Efficient Conv-BN eval on a ResNet-34 (width 64, [3,4,6,3]) at batch 64. The CIFAR stem keeps
# full resolution, so 56 px gives the stages the feature maps an ImageNet ResNet has at 224 px.
sweep efficient_eval 90 experiment=efficient_eval model.width=64 \
    "model.blocks_per_stage=[3,4,6,3]" data.image_size=56 data.batch_size=64 \
    data.num_train=1280 data.num_eval=256 trainer.max_steps=20

# FSDP at world size 1, without and with CPU offload.
sweep fsdp_offload 90 parallel=fsdp parallel.cpu_offload=false,true trainer.max_steps=30

# The report's time ratios against the interleaved plain-step reference (issue 15), on CUDA.
check time_ratios 150 "$py" bench/time_ratios.py --device cuda --repeats 1

tar -C "$sweeps" -czf "$out/sweeps.tgz" --exclude='*.pt' --exclude='*.pickle' . 2>>"$log"
