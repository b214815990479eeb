"""memexp's CUDA estimate against published GPU memory figures.

Each source measured a setting on a GPU and said how it read the memory. The setting is
reproduced as memexp overrides; the estimate (`memexp estimate --target cuda --gpu ...`) is read
the way the source read its GPU:

- nvidia-smi / NVML "used": what the caching allocator reserved, plus the CUDA context. Where
  the source measured its own context (the same process before any model), that figure is used;
  else the GPU table's (memexp.gpus).
- torch.cuda.max_memory_allocated(): the allocated peak (traced tensors, cuBLAS workspaces).
- torch.cuda.max_memory_reserved(): the caching allocator's reserved peak.
- the same, less what was allocated before the measured step (weights and input).

The error is (estimate - published) / published. Within a source, each row's ratio to the
source's first row is compared too: published ratio against estimated ratio. Targets: 10% where
the source states its reading, 0.05 on the ratios.

Where a source's software differs from today's in a way that changes memory, the difference is
named: set with a memexp option where there is one (2022's Trainer kept gradients between steps,
`optim.keep_grads=true`, and stepped AdamW parameter by parameter, `optim.foreach=false`), else
added as its own term (DDP's buckets; torch 1.10's softmax keeping its input), never folded in
silently.

    python bench/published.py [--source KEY]     (about 10 minutes on 2 cores, .venv-cuda)
    python bench/published.py --traces           the same run traced three ways

`--traces` shows what the CUDA trace sees that the CPU stand-in does not: two models at 1024
tokens, estimated for an H100 and a V100 in the CUDA build, and by the CPU stand-in.

Multi-GPU sources set `parallel=ddp|zero1|fsdp` and `trainer.nproc=N` (the same as `memexp
estimate --world-size N`): the estimate is one rank's, traced on torch's fake process group
(memexp.estimate_parallel). Their table gives each row's difference to the source's first row
beside the error.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cache

from hydra.utils import get_class
from omegaconf import DictConfig

from memexp.estimate import Estimate, compose_config, estimate

MIB = 2**20
GIB = 2**30


# -- readings: an estimate as the source read its GPU --------------------------------------------
def nvml_used(result: Estimate, context: int, cfg: DictConfig) -> int:
    return result.memory["reserved_peak_bytes"] + context


def max_allocated(result: Estimate, context: int, cfg: DictConfig) -> int:
    return result.memory["allocated_peak_bytes"]


def max_reserved(result: Estimate, context: int, cfg: DictConfig) -> int:
    return result.memory["reserved_peak_bytes"]


def allocated_above_weights_and_input(result: Estimate, context: int,
                                      cfg: DictConfig) -> int:
    """max_memory_allocated() during forward and backward, less memory_allocated() before
    them: the weights and the input batch (fp32 images, int64 labels)."""
    memory, data = result.memory, cfg.data
    batch = data.batch_size * (data.channels * data.image_size**2 * 4 + 8)
    return memory["allocated_peak_bytes"] - memory["breakdown_at_peak"]["params"] - batch


READINGS = {
    "nvml": ("nvidia-smi / NVML used memory (reserved + CUDA context)", nvml_used),
    "max_allocated": ("torch.cuda.max_memory_allocated()", max_allocated),
    "reserved": ("torch.cuda.max_memory_reserved() (memory_stats' reserved_bytes.all.peak)",
                 max_reserved),
    "above_weights": ("max_memory_allocated() less memory_allocated() before the step",
                      allocated_above_weights_and_input),
}


# -- software differences: each named, as a memexp option where there is one, else a term ------
def ddp_buckets(result: Estimate, cfg: DictConfig) -> int:
    """DistributedDataParallel's gradient buckets: with gradient_as_bucket_view=False (its
    default) the reducer holds a second fp32 copy of every gradient (PyTorch DDP docs,
    `gradient_as_bucket_view`). memexp's estimate covers one process without DDP."""
    return 4 * result.parameters


def torch_1_10_softmax_input(result: Estimate, cfg: DictConfig) -> int:
    """softmax's input, which torch < 1.11 kept for backward beside its output: its
    `_softmax_backward_data` took the input tensor, where 1.11 takes only its dtype (pytorch
    issue #49600; transformers' pytorch_utils switches on `torch < 1.11` for that signature).
    The input is an attention layer's fp32 scores (autocast runs softmax in fp32), one
    (batch, heads, seq, seq) tensor per layer whose activations are held at the peak: every
    layer, or with checkpointing the one layer recomputed during backward."""
    config = cfg.model.config
    checkpointed = not get_class(cfg.checkpointing._target_).baseline
    layers = 1 if checkpointed else config.num_hidden_layers
    scores = cfg.data.batch_size * config.num_attention_heads * cfg.data.seq_len**2
    return layers * scores * 4


def cublas_workspaces_outside_allocator(result: Estimate, cfg: DictConfig) -> int:
    """cuBLAS's workspaces, taken out: torch 1.8 let cuBLAS allocate them itself, outside the
    caching allocator, so max_memory_allocated() did not count them (the source's own figures
    show it: its "before optimizer step()" reading, 992 MB, is the weights, DDP's buckets and
    the gradients, 3 x 335 MB, with nothing left for a workspace)."""
    return -result.memory["cublas_workspace_bytes"]


@dataclass(frozen=True)
class Source:
    key: str
    title: str
    url: str
    setting: str  # what was measured, in the source's terms
    gpu: str  # memexp.gpus key of the source's GPU
    reading: str  # a READINGS key
    base: tuple[str, ...]  # memexp overrides of the shared setting
    rows: tuple[tuple[str, tuple[str, ...], float], ...]  # (label, overrides, published MiB)
    context: int | None = None  # the source's own measured CUDA context, bytes
    # software differences, added: bytes from the estimate and the row's config
    extras: tuple[Callable[[Estimate, DictConfig], int], ...] = ()
    notes: tuple[str, ...] = field(default=())


BERT_LARGE = ("model=hf", "model.arch=bert", "model.task=sequence_classification",
              "+model.config.hidden_size=1024", "+model.config.num_hidden_layers=24",
              "+model.config.num_attention_heads=16", "+model.config.intermediate_size=4096",
              # 2022's BERT: softmax attention written out (SDPA came to BERT in 2024)
              "+model.config.attn_implementation=eager", "data.seq_len=512")
VIT_LARGE = ("model=hf", "model.arch=vit", "model.task=image_classification",
             "+model.config.image_size=224", "+model.config.patch_size=16",
             "+model.config.hidden_size=1024", "+model.config.num_hidden_layers=24",
             "+model.config.num_attention_heads=16", "+model.config.intermediate_size=4096",
             "+model.config.num_labels=1000", "loss=cross_entropy", "data=images",
             "data.image_size=224", "data.num_classes=1000", "data.batch_size=64",
             "data.num_train=128", "data.num_eval=128", "optim=adamw")
RESNET50 = ("model=hf", "model.arch=resnet", "model.task=image_classification",
            "+model.config.num_labels=1000", "loss=cross_entropy", "data=images",
            "data.image_size=224", "data.num_classes=1000", "data.batch_size=64",
            "data.num_train=128", "data.num_eval=128", "optim=sgd")
GA, GC = ("data.batch_size=1", "optim.accumulate=4"), ("checkpointing=full",)
# 2022's Trainer: model.zero_grad() zeroed gradients in place (torch < 2.0's default), and its
# AdamW (adamw_hf) stepped one parameter at a time
ADAMW = ("optim=adamw", "optim.keep_grads=true", "optim.foreach=false")
ADAFACTOR = ("optim=adafactor", "optim.keep_grads=true")
ADAM_8BIT = ("optim=adamw_8bit", "optim.keep_grads=true")

# Llama 2 7B is LlamaConfig's default (4096 wide, 32 layers of 32 heads, 11008 MLP, 32k words)
LLAMA2_7B = ("model=hf", "model.arch=llama")
LLAMA31_8B = (*LLAMA2_7B, "+model.config.intermediate_size=14336",
              "+model.config.num_key_value_heads=8", "+model.config.vocab_size=128256",
              "+model.config.rope_theta=500000.0",
              "+model.config.max_position_embeddings=131072")
# torchtitan's FSDP2 training: bf16 parameters gathered, fp32 reduce-scatter (memexp's fsdp
# under precision=bf16), torch.optim.AdamW(foreach=True)
TORCHTITAN = ("precision=bf16", "optim=adamw", "optim.foreach=true", "parallel=fsdp")
# The ZeroRedundancyOptimizer recipe's model: 20 Linear(2000, 2000), as memexp's MLP on
# 5 x 20 x 20 inputs (2000 features): an input layer, 18 blocks and a 2000-way head
TWENTY_LINEARS = ("model=mlp", "model.hidden=2000", "model.depth=18", "data.channels=5",
                  "data.image_size=20", "data.num_classes=2000", "data.batch_size=20",
                  "data.num_train=40", "data.num_eval=40")
TORCHTITAN_H100 = ("an H100 with 95.04 GiB (HBM2e); memexp's h100 stands in (the readings "
                   "exclude the CUDA context, and the cuBLAS workspace is sm_90's either way)")

SOURCES = (
    Source(
        "hf-anatomy", "Hugging Face transformers docs: Model training anatomy, and Methods and "
        "tools for efficient training on a single GPU (the 2022 V100 experiments)",
        "https://huggingface.co/docs/transformers/model_memory_anatomy",
        "bert-large-uncased sequence classification (2 labels), 512 random tokens, Trainer with "
        "AdamW, 128 steps; Tesla V100-SXM2-16GB, driver CUDA 11.2; NVML used memory after "
        "training; the same stack's context measured as 1343 MiB (torch.ones((1, 1)).to('cuda'))",
        "v100-16gb", "nvml", BERT_LARGE,
        rows=(
            ("batch 4", ("data.batch_size=4", *ADAMW), 14949),
            ("batch 1 x accumulate 4", (*GA, *ADAMW), 8681),
            ("batch 1 x 4, checkpointing", (*GA, *GC, *ADAMW), 6775),
            ("batch 4, fp16 AMP", ("data.batch_size=4", "precision=amp", *ADAMW), 13939),
            ("batch 1 x 4, checkpointing, AMP", (*GA, *GC, "precision=amp", *ADAMW), 7275),
            ("batch 4, Adafactor", ("data.batch_size=4", *ADAFACTOR), 12295),
            ("batch 1 x 4, checkpointing, AMP, Adafactor",
             (*GA, *GC, "precision=amp", *ADAFACTOR), 4847),
            ("batch 4, 8-bit Adam", ("data.batch_size=4", *ADAM_8BIT), 13085),
            ("batch 1 x 4, checkpointing, AMP, 8-bit Adam",
             (*GA, *GC, "precision=amp", *ADAM_8BIT), 5363),
        ),
        context=1343 * MIB,
        extras=(torch_1_10_softmax_input,),
        notes=("torch 1.10 or older: the page's nvidia-smi output is dated 11 January 2022, "
               "before torch 1.11's release (10 March 2022)",
               "Adafactor there is transformers' own; here torch.optim.Adafactor (both factor "
               "the second moment of a matrix into a row and a column)",
               "8-bit Adam there is bitsandbytes' Adam8bit; here torchao's AdamW8bit (both keep "
               "2 bytes of state per parameter)",
               "Trainer's gradient checkpointing checkpoints each BertLayer; checkpointing=full "
               "checkpoints each block memexp resolves (the same layers)")),
    Source(
        "mmengine-1319", "MMEngine PR #1319: activation checkpointing (MMPretrain "
        "vit-large-p16_64xb64_in1k)", "https://github.com/open-mmlab/mmengine/pull/1319",
        "ViT-L/16, 224 px, 64 images per GPU on 2 GPUs (DDP), AdamW, fp32, Mixup, gradient "
        "clipping; MMEngine's logged `memory` (max_memory_allocated, MiB); GPU not stated",
        "a100-80gb", "max_allocated", VIT_LARGE,
        rows=(
            ("no checkpointing", (), 26012),
            ("checkpointing the first 10 of 24 layers",
             ("checkpointing=modules", "checkpointing.modules=["
              + ",".join(f"vit.layers.{i}" for i in range(10)) + "]"), 17842),
        ),
        extras=(ddp_buckets,),
        notes=("GPU assumed A100 80GB (26 GB allocated; fp32 attention takes torch's "
               "memory-efficient kernel on any sm_80+ GPU)",
               "MMPretrain's head has a 3072-wide pre-logits layer (+5.2M parameters, about "
               "80 MiB with gradients and AdamW state); Hugging Face's ViT head has none")),
    Source(
        "mmengine-1319-ddp", "MMEngine PR #1319, the same rows, its 2 DDP ranks traced",
        "https://github.com/open-mmlab/mmengine/pull/1319",
        "as mmengine-1319", "a100-80gb", "max_allocated",
        (*VIT_LARGE, "parallel=ddp", "trainer.nproc=2"),
        rows=(
            ("no checkpointing", (), 26012),
            ("checkpointing the first 10 of 24 layers",
             ("checkpointing=modules", "checkpointing.modules=["
              + ",".join(f"vit.layers.{i}" for i in range(10)) + "]"), 17842),
        ),
        notes=("DistributedDataParallel's buckets are traced (torch's reducer on the fake "
               "process group) in place of mmengine-1319's written-out term",)),
    Source(
        "pytorch-108757", "PyTorch PR #108757: efficient conv-bn eval (inductor pass)",
        "https://github.com/pytorch/pytorch/pull/108757",
        "torchvision ResNet-50 in eval mode (BatchNorm on running statistics), batch 64, "
        "224 px, one forward and backward, eager; max_memory_allocated() less "
        "memory_allocated() before (weights and input); reported in GB (read as GiB); GPU not "
        "stated",
        "a100-80gb", "above_weights", (*RESNET50, "bn_mode=eval"),
        rows=(("eager", (), 5.18 * 1024),
              ("compiled fold", ("bn_mode=efficient_eval",), 2.88 * 1024)),
        notes=("Hugging Face's ResNet-50 config stands in for torchvision's (same bottleneck "
               "layers and widths; torchvision does not import beside torch 2.13)",
               "the PR's fold is an inductor pass under torch.compile, and compiling alone "
               "cost 0.28 GB over eager there (5.46 GB without the pass); "
               "bn_mode=efficient_eval folds eagerly, in a custom autograd function",
               "memexp runs SGD without momentum between steps: no optimizer state, gradients "
               "freed, so its second step's forward and backward is the measured one",
               "cuDNN's convolution workspaces are in the published figure and not in the "
               "estimate")),
    Source(
        "pytorch-zero-recipe", "PyTorch recipe: Shard Optimizer States with "
        "ZeroRedundancyOptimizer (2021)",
        "https://pytorch.org/tutorials/recipes/zero_redundancy_optimizer.html",
        "nn.Sequential of 20 Linear(2000, 2000), fp32, DDP on 2 GPUs, torch.optim.Adam "
        "(lr 0.01) or ZeroRedundancyOptimizer over it, one step on randn(20, 2000) with MSELoss; "
        "rank 0's torch.cuda.max_memory_allocated() // 1e6 after optimizer.step() (MB); "
        "PyTorch 1.8+; GPU not stated",
        "v100-16gb", "max_allocated", (*TWENTY_LINEARS, "optim=adam", "optim.lr=0.01",
                                       "optim.foreach=false", "trainer.nproc=2"),
        rows=(("DDP, Adam", ("parallel=ddp",), 1697e6 / MIB),
              ("DDP, ZeroRedundancyOptimizer(Adam)", ("parallel=zero1",), 1361e6 / MIB)),
        extras=(cublas_workspaces_outside_allocator,),
        notes=("GPU assumed a V100: the allocator's rounding is the same on every GPU, and the "
               "cuBLAS workspace is taken out (above)",
               "torch 1.8's Adam stepped one parameter at a time: optim.foreach=false",
               "memexp's MLP puts a ReLU after each hidden Linear (19 x 160 KB saved) and "
               "trains on cross-entropy: MSELoss against randn labels there",
               "the recipe's peak is its first step's, when Adam creates its state; memexp's "
               "is a later step's, with the state alive throughout: the step is the peak of "
               "both (activations are 160 KB a layer)")),
    Source(
        "torchtitan-165-active", "torchtitan PR #165: Used per-parameter FSDP (FSDP2), the "
        "1D eager run, peak active",
        "https://github.com/pytorch/torchtitan/pull/165",
        "torchtitan's llama 7B (Llama 2 7B: 4096 wide, 32 layers, 32k words), 8 H100s, local "
        "batch 8, sequence 2048 (minipile), FSDP2 (fully_shard per block, bf16 mixed "
        "precision, fp32 reduce-scatter), full activation checkpointing of every block, "
        "AdamW(foreach=True); 'FSDP2 (AC): 23.92% peak active, 32.64% peak reserved', "
        "percentages of 95.0396 GiB (torch.cuda.memory_stats' active_bytes.all.peak and "
        "reserved_bytes.all.peak)",
        "h100", "max_allocated",
        (*LLAMA2_7B, *TORCHTITAN, "checkpointing=full", "data.seq_len=2048",
         "data.batch_size=8", "trainer.nproc=8"),
        rows=(("FSDP2, full AC, 8 ranks: peak active", (), 0.2392 * 95.0396 * 1024),),
        notes=(f"GPU: {TORCHTITAN_H100}",
               "peak active is read as max_memory_allocated(): FSDP2 records no streams, so "
               "no freed block stays active",
               "torchtitan's own Llama (RoPE by complex multiplication, RMSNorm in fp32, "
               "logits cast to fp32 in the model); here Hugging Face's LlamaForCausalLM, whose "
               "loss casts the logits to fp32 likewise",
               "torchtitan keeps the last block gathered after forward "
               "(reshard_after_forward=False for it); memexp reshards every block")),
    Source(
        "torchtitan-165-reserved", "torchtitan PR #165, the same run, peak reserved",
        "https://github.com/pytorch/torchtitan/pull/165",
        "as torchtitan-165-active", "h100", "reserved",
        (*LLAMA2_7B, *TORCHTITAN, "checkpointing=full", "data.seq_len=2048",
         "data.batch_size=8", "trainer.nproc=8"),
        rows=(("FSDP2, full AC, 8 ranks: peak reserved", (), 0.3264 * 95.0396 * 1024),),
        notes=(f"GPU: {TORCHTITAN_H100}",
               "not modelled: torch's caching allocator reuses a freed block only on the "
               "stream it was allocated for, and FSDP2 allocates its all-gather and "
               "reduce-scatter buffers on streams of its own; memexp's allocator model has one "
               "stream")),
    Source(
        "torchtitan-2412", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 "
        "and 3: the FSDP rows",
        "https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
        "llama3_h100_202412_torchtitan.md",
        "Llama 3.1 8B, FSDP2 on 8 (Table 1) and 128 (Table 3) H100s, local batch 2, sequence "
        "8192 (train_configs/llama3_8b.toml at torchtitan 9dec370), selective activation "
        "checkpointing per op ('op': mm outputs saved every other, attention saved), bf16 "
        "parameters, fp32 reduce-scatter, AdamW(foreach=True), logits cast to fp32 for the "
        "loss; 'Memory(GiB)': the log's max_reserved_gib (reserved_bytes.all.peak), read at "
        "the 90th step: 82.4 on 8 GPUs, 67.0 on 128",
        "h100", "reserved",
        (*LLAMA31_8B, *TORCHTITAN, "checkpointing=selective_ops", "data.seq_len=8192",
         "data.batch_size=2"),
        rows=(("FSDP2, per-op SAC, 8 ranks", ("trainer.nproc=8",), 82.4 * 1024),
              ("FSDP2, per-op SAC, 128 ranks", ("trainer.nproc=128",), 67.0 * 1024)),
        notes=("checkpointing=selective_ops is torchtitan's 'op' mode with its save list "
               "(memexp.techniques.checkpointing.TORCHTITAN_SAVE): every other mm kept. The "
               "activations are the same at 8 and 128 ranks (the local batch is), so the "
               "difference between the rows is the sharded parameters, gradients and AdamW "
               "state",
               f"GPU: {TORCHTITAN_H100}")),
)

# Sources read, but not reproducible here: what they lack.
NOT_REPRODUCED = (
    ("the seeds' AMP table (Spell blog, 2020: V100 and T4; tiny feed-forward, UNet, BERT)",
     "memory read from Spell's GPU metrics (\"PyTorch memory reservation\"); the feed-forward "
     "network's sizes and BERT's batch and sequence length are not given; the UNet "
     "(ResidentMario/spell-unet-bob-ross: batch 8, 256 px, Adam) is a segmentation model, and "
     "memexp's data sets are classification and tokens"),
    ("the seeds' BERT checkpointing table (Explore Gradient-Checkpointing in PyTorch: b24 "
     "10972 -> 3944 MB, b132 10212 MB)",
     "model size, sequence length, GPU and how memory was read are not given"),
    ("the same page's torch.compile and Float8 rows (Tables 1 and 3), and Tables 2, 4, 5 and 6",
     "torch.compile, Float8 linears and their float8 all-gather, context, tensor and pipeline "
     "parallelism are not modelled"),
    ("torchtitan PR #165's FSDP1 rows (AC 24.81% active, 33.82% reserved; SAC 52.98%, "
     "67.23%)", "FSDP1 (FullyShardedDataParallel, flat parameters) is not a memexp option: "
     "parallel=fsdp is FSDP2's fully_shard"),
    ("torchtitan PR #165's SAC, compiled and 2D (FSDP + sequence parallel) rows",
     "torch.compile and tensor parallelism are not modelled; the eager SAC row is not rerun "
     "with checkpointing=selective_ops yet (only torchtitan-2412 was)"),
    ("torchtitan PR #97 (Llama 7B: full AC 28.12% allocated, 40.61% reserved; SAC 62.0%, "
     "80.45%)", "FSDP1, and the world size, batch and sequence length are not given"),
    ("torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Llama 3.1 8B on 32 and 64 "
     "H200s: 47.96, 46.97 GiB)", "torch.compile and Float8 with float8 all-gather"),
    ("llama-cookbook PR #165 (LLaMA-7B on 8 GPUs, use_cache: 14.93 GB active, 19.52 GB "
     "reserved before)", "a prototype FSDP; batch, sequence length and precision are not "
     "given in the PR"),
    ("llama-cookbook PR #41 (LLaMA-7B LoRA on 4 A100s: 15.22 GB active, 19.36 GB reserved)",
     "FSDP1 with LoRA (PEFT): neither is a memexp option"),
)


@dataclass
class Result:
    source: Source
    label: str
    published: int  # bytes
    predicted: int  # bytes, as the source read memory
    estimate: Estimate
    seconds: float

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published


@cache
def estimated(overrides: tuple[str, ...], gpu: str) -> tuple[Estimate, DictConfig, float]:
    """One estimate, once: two sources that read one run two ways share it."""
    started = time.perf_counter()
    cfg = compose_config(list(overrides))
    return estimate(cfg, "cuda", gpu), cfg, time.perf_counter() - started


def breakdown(result: Estimate) -> str:
    """What the traced peak held, by category: which state a difference between rows is."""
    return ", ".join(f"{role} {nbytes / MIB:,.0f}" for role, nbytes
                     in result.memory["breakdown_at_peak"].items() if nbytes) + " MiB"


def run(source: Source) -> list[Result]:
    results = []
    for label, extra, published_mib in source.rows:
        result, cfg, seconds = estimated((*source.base, *extra), source.gpu)
        context = source.context if source.context is not None else result.memory[
            "context_bytes"]
        predicted = READINGS[source.reading][1](result, context, cfg)
        predicted += sum(extra_bytes(result, cfg) for extra_bytes in source.extras)
        results.append(Result(source, label, int(published_mib * MIB), predicted, result,
                              seconds))
        print(f"  {source.key}: {label}: published {published_mib:,.0f} MiB, estimate "
              f"{predicted / MIB:,.0f} MiB ({results[-1].error:+.1%}), trace "
              f"{result.trace}, rank {result.rank} of {result.world_size}, peak in "
              f"{result.memory['peak_phase']} ({breakdown(result)}), "
              f"{results[-1].seconds:.0f} s", flush=True)
    return results


def with_first(results: list[Result]) -> list[tuple[Result, Result]]:
    """Each result beside its source's first row, which ratios and differences are taken to."""
    firsts: dict[str, Result] = {}
    return [(r, firsts.setdefault(r.source.key, r)) for r in results]


def table(results: list[Result]) -> str:
    lines = ["| source | setting | GPU | trace | attention | published MiB | estimate MiB | "
             "error | ratio published | ratio estimate | ratio diff |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r, first in with_first(results):
        ratio_published = r.published / first.published
        ratio_estimate = r.predicted / first.predicted
        attention = ", ".join(sorted({op.removeprefix("aten._scaled_dot_product_")
                                      for op in r.estimate.ops.get("forward", ())
                                      if op.startswith("aten._scaled_dot_product_")})) or "-"
        lines.append(
            f"| {r.source.key} | {r.label} | {r.source.gpu} | {r.estimate.trace} | {attention} | "
            f"{r.published / MIB:,.0f} | {r.predicted / MIB:,.0f} | {r.error:+.1%} | "
            f"{ratio_published:.3f} | {ratio_estimate:.3f} | "
            f"{ratio_estimate - ratio_published:+.3f} |")
    return "\n".join(lines)


def parallel_table(results: list[Result]) -> str:
    """The multi-GPU rows: the rank traced, and each row's difference to its source's first."""
    lines = ["| source | setting | rank of | GPU | trace | published MiB | estimate MiB | error | "
             "published - first row | estimate - first row | its error |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r, first in with_first(results):
        difference = "| - | - | - |"
        if r is not first:
            published, predicted = r.published - first.published, r.predicted - first.predicted
            difference = (f"| {published / MIB:+,.0f} | {predicted / MIB:+,.0f} | "
                          f"{(predicted - published) / abs(published):+.1%} |")
        lines.append(
            f"| {r.source.key} | {r.label} | {r.estimate.rank} of {r.estimate.world_size} | "
            f"{r.source.gpu} | {r.estimate.trace} | {r.published / MIB:,.0f} | "
            f"{r.predicted / MIB:,.0f} | {r.error:+.1%} {difference}")
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    within = sum(abs(r.error) <= 0.10 for r in results)
    ratios = [r.predicted / first.predicted - r.published / first.published
              for r, first in with_first(results) if r is not first]
    lines = [f"errors within 10%: {within} of {len(results)} rows; largest |error| "
             f"{max(abs(r.error) for r in results):.1%}"]
    if ratios:
        lines.append(f"ratios within 0.05: {sum(abs(d) <= 0.05 for d in ratios)} of "
                     f"{len(ratios)}; largest |diff| {max(abs(d) for d in ratios):.3f}")
    return "\n".join(lines)


def command(overrides: tuple[str, ...], gpu: str) -> str:
    """The `memexp estimate` line of a row: trainer.nproc=N written as --world-size N."""
    ranks = [o.removeprefix("trainer.nproc=") for o in overrides if o.startswith("trainer.nproc=")]
    kept = [o for o in overrides if not o.startswith("trainer.nproc=")]
    world = [f"--world-size {ranks[-1]}"] if ranks else []
    return " ".join(["memexp estimate", *kept, *world, "--target cuda", f"--gpu {gpu}"])


def describe_sources(sources: tuple[Source, ...]) -> str:
    lines = []
    for s in sources:
        # an extra's docstring names it before its first colon
        extras = "; ".join(f"+ {e.__doc__.split(':')[0]}" for e in s.extras)
        context = (f"its own measured context, {s.context / MIB:,.0f} MiB" if s.context
                   else "context from memexp.gpus")
        lines.append(f"- **{s.key}**: {s.title} ({s.url}). Setting: {s.setting}. memexp: "
                     f"`{' '.join(s.base)}` --gpu {s.gpu}; reading: "
                     f"{READINGS[s.reading][0]} ({context}){'; ' + extras if extras else ''}.")
        if any(o.startswith("trainer.nproc=") for row in s.rows for o in (*s.base, *row[1])):
            lines += [f"  - {label}: `{command((*s.base, *extra), s.gpu)}`"
                      for label, extra, _ in s.rows]
        lines += [f"  - {note}" for note in s.notes]
    lines.append("- Not reproduced:")
    lines += [f"  - {what}: {why}" for what, why in NOT_REPRODUCED]
    return "\n".join(lines)


# One config per row block of `--traces`, each at 1024 tokens, batch 8, amp.
TRACED = {
    "memexp transformer (4 layers, d_model 512)": (
        "model=transformer", "model.n_layers=4", "model.d_model=512", "model.n_heads=8",
        "data.seq_len=1024", "data.batch_size=8", "data.num_train=64", "data.num_eval=16"),
    "Hugging Face GPT-2 (4 layers), padded batches": (
        "model=hf", "model.arch=gpt2", "model.task=causal_lm", "+model.config.n_layer=4",
        "data.seq_len=1024", "data.batch_size=8"),
}


@contextmanager
def cpu_stand_in():
    """Estimates in this block trace the CPU kernels, as where no CUDA build is installed."""
    previous = os.environ.get("MEMEXP_CUDA_PYTHON")
    os.environ["MEMEXP_CUDA_PYTHON"] = "none"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["MEMEXP_CUDA_PYTHON"]
        else:
            os.environ["MEMEXP_CUDA_PYTHON"] = previous


def traces() -> str:
    """Each TRACED config three ways: the CUDA build on a fake H100 and a fake V100, and the
    CPU stand-in (MEMEXP_CUDA_PYTHON=none) for the H100."""
    lines = ["| config | traced as | attention kernel | allocated MiB | reserved MiB |",
             "|---|---|---|---:|---:|"]
    for name, overrides in TRACED.items():
        cfg = compose_config([*overrides, "precision=amp"])
        for gpu, stand_in in (("h100", False), ("v100-16gb", False), ("h100", True)):
            with cpu_stand_in() if stand_in else nullcontext():
                result = estimate(cfg, "cuda", gpu)
            attention = ", ".join(op.removeprefix("aten.") for op in result.ops["forward"]
                                  if op.startswith("aten._scaled_dot_product_")) or "math"
            memory = result.memory
            lines.append(f"| {name} | {result.trace}, {gpu} | {attention} | "
                         f"{memory['allocated_peak_bytes'] / MIB:,.1f} | "
                         f"{memory['reserved_peak_bytes'] / MIB:,.1f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", choices=[s.key for s in SOURCES], action="append",
                        help="only these sources (repeatable)")
    parser.add_argument("--traces", action="store_true",
                        help="one config traced three ways, instead of the sources")
    args = parser.parse_args()
    if args.traces:
        print(traces())
        return
    sources = tuple(s for s in SOURCES if not args.source or s.key in args.source)
    results = [r for source in sources for r in run(source)]
    one = [r for r in results if r.estimate.world_size == 1]
    ranks = [r for r in results if r.estimate.world_size > 1]
    for rows, table_of in ((one, table), (ranks, parallel_table)):
        if rows:
            print()
            print(table_of(rows))
    print()
    print(summary(results))
    print()
    print(describe_sources(sources))


if __name__ == "__main__":
    main()
