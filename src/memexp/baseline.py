"""A run's baseline: its workload with no memory technique, what its ratios are taken against.

A run's baseline resets each technique group that has a baseline option: the option whose class
says `baseline = True` (precision's FP32, checkpointing's NoCheckpointing, bn_mode's TrainBN;
optim and parallel have none: they are the workload). Accumulating k micro-batches of b samples
is the workload of one batch of k * b. The sweep report compares each run with its workload's
baseline run, and a run times its own baseline beside it (memexp.paired.PairedBaseline), so that
their time ratio sees the same machine at the same moments.
"""

from __future__ import annotations

import copy

from hydra.utils import get_class

from memexp import registry
from memexp.checkpoint import fingerprint

# the technique groups with a baseline option, which a run's baseline resets
BASELINE_GROUPS = tuple(group for group in registry.techniques()
                        if registry.baseline_option(group) is not None)

# What a run's baseline may leave different from the sweep's baseline run and still take the
# same steps: how memory is measured, how the steps are timed, and the evaluation.
NOT_THE_STEP = ("memory.", "timing.", "data.eval_batch_size", "trainer.eval_every",
                "trainer.warmup_steps")


def is_baseline(config: dict) -> bool:
    """A run whose every BASELINE_GROUPS option is its group's baseline. A record written before
    a group existed (adapter, compile) ran without it: at that group's baseline."""
    return all(group not in config or get_class(config[group]["_target_"]).baseline
               for group in BASELINE_GROUPS)


def baseline_config(config: dict) -> dict | None:
    """`config` (resolved) with BASELINE_GROUPS at their baseline options and its micro-batches
    as one batch; None where that is `config` itself."""
    accumulate = config["optim"]["accumulate"]
    if is_baseline(config) and accumulate == 1:
        return None
    base = copy.deepcopy(config)
    for group in BASELINE_GROUPS:
        option = registry.options(group)[registry.baseline_option(group)]
        base[group] = {"_target_": option["_target_"]}
    base["data"]["batch_size"] *= accumulate
    base["optim"]["accumulate"] = 1
    return base


def same_steps(a: dict, b: dict) -> bool:
    """Whether two resolved configs train with the same steps (NOT_THE_STEP aside)."""
    def steps(config: dict) -> dict:
        return {key: value for key, value in fingerprint(config).items()
                if not key.startswith(NOT_THE_STEP)}

    return steps(a) == steps(b)
