"""loss=chunked_ce on transformers' causal language models: its loss equals the model's own
(to 1e-5), taking what the forward does after the head on each chunk, or it refuses the model
naming why. bench/chunked_ce_models.py sweeps every architecture of the installed transformers'
causal-LM table (its table is the figures docs/techniques.md quotes); this is a fixed slice of
it: each kind of step after the head that the sweep meets, and each kind of outcome."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO

# the bench script, imported from its file (Python's recipe for a source file outside the path)
_spec = importlib.util.spec_from_file_location("chunked_ce_models",
                                               REPO / "bench" / "chunked_ce_models.py")
sweep = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

# name -> (how it ends, what the forward does after its head)
SLICE = {
    "llama": ("agrees", ""),
    "gpt2": ("agrees", ""),  # the head tied to the embedding
    "opt": ("agrees", "torch.Tensor.contiguous"),
    "cohere": ("agrees", "torch.Tensor.mul"),  # * logit_scale
    "granite": ("agrees", "torch.Tensor.div"),  # / logits_scaling
    "gemma2 softcap=2": ("agrees", "torch.Tensor.div, torch.tanh, torch.Tensor.mul"),
    "recurrent_gemma": ("agrees", "torch.Tensor.div, torch.Tensor.tanh, torch.Tensor.mul"),
    "xlstm": ("agrees", "torch.Tensor.float, torch.Tensor.div, torch.tanh, torch.Tensor.mul"),
    "mamba": ("agrees", "torch.Tensor.float"),
    "qwen3_moe": ("agrees", ""),
    # its own loss compares position t with label t: chunked_ce is compared with cross_entropy
    "trocr": ("own loss not shifted", ""),
    "inkling_text unpadded_vocab_size=100": ("refused", ""),  # slices the vocabulary
    "bart": ("model=hf refuses", ""),  # the decoder of an encoder-decoder alone
}


@pytest.mark.parametrize("name", SLICE)
def test_chunked_ce_computes_the_model_s_own_loss_or_refuses_naming_why(name):
    outcome = sweep.quietly(sweep.compare, name)
    status, steps = SLICE[name]
    assert outcome.status == status, outcome.why
    if status in ("agrees", "own loss not shifted"):
        assert outcome.relative() <= sweep.TOLERANCE
        assert outcome.steps == steps
    if status == "refused":
        assert outcome.why.startswith(
            "loss=chunked_ce: after its output head lm_head, InklingForCausalLM's forward takes "
            "torch.Tensor.__getitem__ on the logits, which makes a tensor of shape (2, 16, 100) "
            "from logits of shape (2, 16, 128)")
