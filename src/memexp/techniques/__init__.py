"""Memory techniques: one module per config group, one small class per option.

Every technique object has `apply(model) -> model` for its structural change (the baseline options
return the model untouched). Per-step behaviour is a context or a hook, named by the group's
protocol in its module: `precision` owns autocast, backward and the optimizer step; `checkpointing`
a context around the forward; `optim` builds the optimizer; `parallel` places the model on ranks.
The trainer applies them in one fixed, commented order (`memexp.trainer.Trainer.__init__`).
"""
