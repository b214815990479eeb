"""loss=chunked_ce against each causal language model's own loss, over every architecture in the
installed transformers' causal-LM table, each built from a small config (random weights, nothing
downloaded), on CPU; and a few architectures again with a config key that changes what their
forward does after the head (VARIANTS).

For each: one batch through memexp's own loss classes (memexp.loss): the model's own loss
(loss=model, labels passed in: from a second pass, as a first may change the model), then the
model with its head deferred to loss=chunked_ce, its loss and backward. Each ends one way:
- `agrees`: chunked_ce's loss within 1e-5 of the model's own (relative); `steps` names what the
  forward does after its head, which chunked_ce took on each chunk;
- `own loss not shifted`: the model's own loss is not the shifted cross-entropy of its logits
  (it predicts position t from t), which model.task=causal_lm's losses are: chunked_ce is
  compared with memexp's cross_entropy (shift=true) on the model's logits instead;
- `refused`: chunked_ce refused the model, saying why;
- `differs`: a wrong figure (tests/test_chunked_ce_models.py fails on one);
- `model=hf refuses`: memexp's model=hf does not build the class for model.task=causal_lm (the
  decoder of an encoder-decoder alone);
- `not built`: not buildable from a small config here, or not runnable on token ids alone.

    python bench/chunked_ce_models.py [--arch gemma2 --arch cohere ...]

tests/test_chunked_ce_models.py runs a fixed slice of this sweep in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from memexp.data.tensors import IGNORE
from memexp.loss import ChunkedCrossEntropy, CrossEntropy, ModelLoss, as_loss, call_model

TOLERANCE = 1e-5  # relative, against the model's own loss
# Small configs: the keys transformers' config classes name these sizes by, where a class has
# them (nested configs too: a multimodal model's text_config).
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
          "num_decoder_layers")
SIZES = (
    (64, ("hidden_size", "n_embd", "d_model", "embed_dim", "model_dim", "word_embed_proj_dim",
          "emb_dim", "embedding_dim")),
    # (as many key and value heads as heads: multi-head latent attention needs that)
    (4, ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
         "num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
         "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    (2, ("num_experts_per_tok", "top_k", "moe_topk", "num_experts_per_token", "moe_k")),
    (1, ("n_group", "topk_group", "n_shared_experts", "expand")),
    (16, ("head_dim", "kv_channels", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
          "qk_head_dim", "d_head", "rotary_dim", "mamba_d_head", "linear_key_head_dim",
          "linear_value_head_dim", "mamba_d_state", "state_size", "mamba_chunk_size",
          "chunk_size", "hidden_size_per_layer_input")),
    (8, ("mamba_n_heads", "time_step_rank", "linear_num_key_heads", "linear_num_value_heads")),
    (128, ("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "ffn_hidden_size",
           "d_ff", "d_inner", "vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input",
           "shared_intermediate_size", "intermediate_size_mlp")),
    (32, ("moe_intermediate_size", "expert_intermediate_size",
          "shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank")),
    (64, ("max_position_embeddings", "n_positions", "n_ctx")),
)
VOCAB = 128
SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
               "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")
MAX_PARAMETERS = 50_000_000  # what "small" allows: a pass in well under a second
STATUSES = ("agrees", "own loss not shifted", "refused", "differs", "model=hf refuses",
            "not built")
# An architecture again, with config keys that change what its forward does after the head:
# Gemma 2's soft cap at 2 (its default of 30 barely touches random logits), and Inkling's slice
# of a padded vocabulary (a step no chunk can take).
VARIANTS = {"gemma2 softcap=2": ("gemma2", {"final_logit_softcapping": 2.0}),
            "inkling_text unpadded_vocab_size=100": ("inkling_text",
                                                     {"unpadded_vocab_size": 100})}


@dataclass
class Outcome:
    arch: str  # or a variant's name (VARIANTS)
    model: str  # the class built, or the table's name for it where none was built
    status: str  # one of STATUSES
    own: float | None = None  # the loss chunked_ce is compared with
    chunked: float | None = None
    steps: str = ""  # what the forward does after the head (memexp.models.head.PostHead)
    why: str = ""
    seconds: float = 0.0

    def relative(self) -> float | None:
        if self.own is None or self.chunked is None:
            return None
        return abs(self.chunked - self.own) / max(abs(self.own), 1e-12)


def causal_lm_architectures() -> dict[str, str]:
    """Every architecture of the causal-LM table, then the variants: name -> class name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {**MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            **{name: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch]
               for name, (arch, _) in VARIANTS.items()}}


def small(values: dict, layers: int | None) -> dict:
    """The config's sizes, shrunk (to `layers` layers, where not None): only the keys changed,
    nested configs (a multimodal model's text_config) as their own changed keys."""
    shrunk = {}
    for key, value in values.items():
        if isinstance(value, dict):
            # a nested config by its changed keys (its class fills in the rest); another
            # mapping (rope_parameters) whole
            if inner := small(value, layers):
                shrunk[key] = inner if "model_type" in value else {**value, **inner}
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if key in LAYERS and layers is not None:
            shrunk[key] = min(value, layers)
        for size, keys in SIZES:
            if key in keys:
                shrunk[key] = min(value, size)
        if key in SPECIAL_IDS and value >= VOCAB:
            shrunk[key] = SPECIAL_IDS.index(key)
    return shrunk


def build(arch: str, keys: dict) -> tuple[nn.Module, dict, float]:
    """The causal LM of `arch` from a small config (2 layers where that runs, else 4, else the
    class's own number: some tie a layer pattern to it), its batch, and its own loss on that
    batch: from a second pass (a first may change the model: BigBird picks its attention for
    the sequence's length)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[arch]
    defaults = config_class().to_dict()
    errors = []
    for layers in (2, 4, None):
        try:
            # a decoder (BERT-like classes train as one only so), with no KV cache
            config = config_class(**{**small(defaults, layers), **keys}, is_decoder=True,
                                  use_cache=False)
            with torch.device("meta"):  # counted before any is made
                parameters = sum(p.numel() for p in
                                 AutoModelForCausalLM.from_config(config).parameters())
            if parameters > MAX_PARAMETERS:
                raise RuntimeError(f"{parameters:,} parameters at the smallest sizes tried")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            model.train()
            batch = token_batch()
            own = as_loss(ModelLoss(shift=True), model)
            with torch.no_grad():
                losses = [own(forward(model, batch, own), batch) for _ in range(2)]
            if losses[-1] is None:
                raise RuntimeError(f"{type(model).__name__} returned no loss of its own")
        except Exception as error:  # a config whose sizes hang together otherwise
            errors.append(first_line(error))
            continue
        return model, batch, float(losses[-1])
    raise RuntimeError(errors[-1])


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def token_batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    # ids past the special ones (a small config's are 0 to 7), within every model's vocabulary
    # (some add ids past vocab_size, one slices its classes to 100: VARIANTS)
    ids = torch.randint(len(SPECIAL_IDS), 100, (2, 16), generator=generator)
    labels = ids.clone()
    labels[0, -3:] = IGNORE  # padding, as data=hf_tokens pads
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def forward(model: nn.Module, batch: dict, loss):
    # dropout, and any other random draw: the same in every pass
    torch.manual_seed(0)
    np.random.seed(0)
    return call_model(model, batch, loss.passes_labels)


def compare(name: str) -> Outcome:
    """`name`: an architecture, or a variant (VARIANTS)."""
    from memexp.models.hf import check_choice

    table = causal_lm_architectures()[name]
    arch, keys = VARIANTS.get(name, (name, {}))
    started = time.perf_counter()
    try:
        check_choice(arch, "causal_lm")  # as model=hf model.task=causal_lm builds it
    except ValueError as error:
        return Outcome(name, table, "model=hf refuses", why=str(error))
    try:
        model, batch, own = build(arch, keys)
    except Exception as error:
        return Outcome(name, table, "not built", why=first_line(error),
                       seconds=time.perf_counter() - started)
    with torch.no_grad():
        # what causal language modelling's loss is on the model's own logits (memexp's
        # cross_entropy, shifted): a model whose own loss is not it is compared with it instead
        outputs = forward(model, batch, CrossEntropy(shift=True))
        shifted = float(CrossEntropy(shift=True)(outputs, batch))
    del outputs
    try:
        loss = as_loss(ChunkedCrossEntropy(shift=True, chunk_tokens=8), model)
        outputs = forward(model, batch, loss)
        loss.check(outputs, batch)
        value = loss(outputs, batch)
        value.backward()
    except ValueError as error:  # a refusal: bad input told, naming why
        return Outcome(name, type(model).__name__, "refused", own, why=str(error),
                       seconds=time.perf_counter() - started)
    outcome = Outcome(name, type(model).__name__, "agrees", own, float(value),
                      loss.head.program().describe(), seconds=time.perf_counter() - started)
    if not abs(shifted - own) <= TOLERANCE * abs(own):
        outcome.status, outcome.own = "own loss not shifted", shifted
        outcome.why = (f"the model's own loss, {own:.6f}, is not the shifted cross-entropy of "
                       "its logits (chunked_ce is compared with that)")
    if not outcome.relative() <= TOLERANCE:
        outcome.status = "differs"
    return outcome


def quietly(function, *args):
    """`function(*args)` without transformers' warnings and logs about tiny configs."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return function(*args)
        finally:
            logging.disable(logging.NOTSET)


def sweep(archs: list[str]) -> list[Outcome]:
    torch.set_num_threads(1)
    return [quietly(compare, arch) for arch in archs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="only these (default: every one)")
    args = parser.parse_args()
    import transformers
    from machine import describe_machine

    print(describe_machine())
    archs = args.arch or list(causal_lm_architectures())
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: "
          f"{len(archs)} causal-LM architectures\n")
    started = time.perf_counter()
    outcomes = sweep(archs)
    print("| arch | class | status | after the head | model's loss | chunked_ce's | relative "
          "| s | why |")
    print("|---|---|---|---|---|---|---|---|---|")
    for o in outcomes:
        relative = o.relative()
        print(f"| {o.arch} | {o.model} | {o.status} | {o.steps} | "
              f"{'' if o.own is None else f'{o.own:.6f}'} | "
              f"{'' if o.chunked is None else f'{o.chunked:.6f}'} | "
              f"{'' if relative is None else f'{relative:.1e}'} | {o.seconds:.2f} | {o.why} |")
    counts = {status: sum(o.status == status for o in outcomes)
              for status in STATUSES}
    print(f"\n{len(outcomes)} architectures in {time.perf_counter() - started:.0f} s: "
          + ", ".join(f"{count} {status}" for status, count in counts.items()))


if __name__ == "__main__":
    main()
