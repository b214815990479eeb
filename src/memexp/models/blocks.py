"""Which modules are "the blocks": one resolver for every block-level technique.

Checkpointing (`full`, `selective`, `modules`, `sequential`, `offload`'s scope), FSDP's per-block
sharding and efficient_eval's `modules` all name their modules the same way, as a list:

- `[auto]`: the largest group of same-class modules (with submodules of their own) that sit in an
  `nn.ModuleList` or `nn.Sequential`: GPT2Block, BertLayer, timm's BasicBlock and ConvNeXtBlock,
  memexp's own blocks. Ties go to the class with more siblings in one container; classes that
  still tie are all taken, and so are the groups held beside the chosen ones, in a container
  whose name differs from theirs in one named part only (BART's `model.decoder.layers` beside
  `model.encoder.layers`, of whatever depth): choosing one would leave the other half of an
  encoder-decoder unchanged;
- class names, such as `[GPT2Block]` (every module of that class);
- glob patterns over module names, such as `[transformer.h.*]` or `[layer*.*]`.

Only the outermost matches count (`transformer.h.*` also matches each block's insides). A module
held in several places (`ModuleList([shared, block, shared])`) is found at each of them: every
call of it is a block. Techniques wrap what they find in place, as torch's
`apply_activation_checkpointing` does: the wrapper takes the module's place in its parent, and the
model's own forward is untouched.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

AUTO = "auto"


class Wrapper(nn.Module):
    """A technique's wrapper around one module (`inner`), set in that module's place. The
    resolver sees through it: it counts as its inner module's class."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str):
        """Attributes the wrapper lacks are the inner module's, as in torch's CheckpointWrapper:
        a model's forward may read its blocks' attributes (nn.TransformerEncoder reads
        `self.layers[0].self_attn.batch_first`)."""
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules: `inner`
        except AttributeError:
            return getattr(self.inner, name)


def unwrapped(module: nn.Module) -> nn.Module:
    while isinstance(module, Wrapper):
        module = module.inner
    return module


def class_name(module: nn.Module) -> str:
    return type(unwrapped(module)).__name__


@dataclass
class Blocks:
    """What a resolver spec found: module names in model order, and the modules."""

    names: list[str]
    modules: list[nn.Module]

    def summary(self) -> dict:
        """For result.json's techniques.blocks: class (or classes) and count."""
        classes = dict.fromkeys(class_name(m) for m in self.modules)
        return {"class": ", ".join(classes), "count": len(self.names)}

    def describe(self) -> str:
        parents = list(dict.fromkeys(name.rpartition(".")[0] or "(root)" for name in self.names))
        where = ", ".join(parents[:4]) + (f" and {len(parents) - 4} more" if len(parents) > 4
                                          else "")
        summary = self.summary()
        return f"{summary['class']} x{summary['count']} in {where}"


def outermost(names: list[str]) -> list[str]:
    """`names` (in model order, where a module's insides follow it) without those inside
    another of them."""
    chosen: list[str] = []
    for name in names:
        if not (chosen and name.startswith(chosen[-1] + ".")):
            chosen.append(name)
    return chosen


def _has_children(module: nn.Module) -> bool:
    return next(unwrapped(module).children(), None) is not None


def _has_grandchildren(module: nn.Module) -> bool:
    """Whether a submodule of `module` has submodules of its own: a layer made of layers (a
    transformer layer's attention and MLP), not of single ops (a convolution, its norm and
    activation)."""
    return any(_has_children(child) for child in unwrapped(module).children())


def all_named_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every (name, module) of `model`, a module held in several places at each of them
    (`named_modules()` names it once, and a technique would then miss its other calls)."""
    return dict(model.named_modules(remove_duplicate=False))


def auto_blocks(model: nn.Module) -> list[str]:
    """Names of the largest group (or groups, where they tie) of same-class composite modules
    held in containers, with the groups held beside them."""
    modules = all_named_modules(model)
    kinds: dict[str, str] = {}  # member name -> its class, in model order
    here: Counter = Counter()  # (container, class) -> members in that container
    for name, child in modules.items():
        container = name.rpartition(".")[0]
        if (name and not isinstance(modules[container], Wrapper)
                and isinstance(modules[container], (nn.ModuleList, nn.Sequential))
                and _has_children(child)):
            kinds[name] = class_name(child)
            here[container, kinds[name]] += 1
    if not kinds:
        return []
    counts = Counter(kinds.values())
    siblings: Counter = Counter()
    for (_, kind), count in here.items():
        siblings[kind] = max(siblings[kind], count)
    # Layers made of single ops (a convolution, its norm and activation) that sit outside every
    # group of layers made of layers are not the blocks: wav2vec2's, HuBERT's and WavLM's
    # convolutional feature encoder (7 such layers) beside their transformer layers (1 to 24).
    # Inside such a group they are (ConvNeXt's layers in its stages, RegNet's in its Y layers).
    nested = {name for name, kind in kinds.items() if _has_grandchildren(modules[name])}
    flat_outside = {kind for kind in counts if nested and not any(
        name in nested or any(name.startswith(f"{outer}.") for outer in nested)
        for name, of in kinds.items() if of == kind)}
    counts = Counter({kind: count for kind, count in counts.items()
                      if kind not in flat_outside})
    best = max((counts[kind], siblings[kind]) for kind in counts)
    chosen = {kind for kind in counts if (counts[kind], siblings[kind]) == best}
    places = {container for container, kind in here if kind in chosen}
    chosen |= {kind for container, kind in here
               if any(beside(container, place) for place in places)}
    return outermost([name for name, kind in kinds.items() if kind in chosen])


def beside(a: str, b: str) -> bool:
    """Whether module names `a` and `b` differ in one of their dotted parts only, a name rather
    than an index: model.encoder.layers and model.decoder.layers, not stages.0.layers and
    stages.1.layers (a stage's extra modules, such as RegNet's squeeze-excitation layers, are
    not the blocks)."""
    parts_a, parts_b = a.split("."), b.split(".")
    if len(parts_a) != len(parts_b):
        return False
    differ = [(x, y) for x, y in zip(parts_a, parts_b, strict=True) if x != y]
    return len(differ) == 1 and not any(part.isdigit() for part in differ[0])


def repeating_classes(model: nn.Module) -> str:
    counts = Counter(class_name(m) for name, m in model.named_modules() if name)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common() if n > 1) or "none"


def module_names(model: nn.Module) -> str:
    """The top two levels of module names, and how many deeper ones there are."""
    names = [name for name, _ in model.named_modules() if name]
    shallow = [name for name in names if name.count(".") <= 1]
    deeper = len(names) - len(shallow)
    return ", ".join(shallow) + (f" (and {deeper} deeper ones, from model.named_modules())"
                                 if deeper else "")


def resolve_blocks(model: nn.Module, spec: Sequence[str], key: str) -> Blocks:
    """The modules `spec` names (see the module docstring); a clear error naming `key` when it
    names none."""
    spec = list(spec)
    if not spec:
        raise ValueError(f"{key}=[]: name the blocks: [auto], class names such as [GPT2Block], "
                         "or module-name globs such as [transformer.h.*]")
    modules = {name: module for name, module in all_named_modules(model).items() if name}
    if spec == [AUTO]:
        names = auto_blocks(model)
        if not names:
            raise ValueError(
                f"{key}=[auto] found no repeated blocks in {type(model).__name__}: auto looks "
                "for same-class modules with submodules inside an nn.ModuleList or "
                f"nn.Sequential. Name them as {key}=[ClassName] or {key}=['glob.*']. Classes "
                f"that repeat: {repeating_classes(model)}. Module names: {module_names(model)}")
    else:
        names = []
        for entry in spec:
            matched = ([n for n, m in modules.items() if class_name(m) == entry]
                       or [n for n in modules if fnmatch.fnmatchcase(n, entry)])
            if not matched:
                raise ValueError(
                    f"{key}: {entry!r} names no module class and no module name of "
                    f"{type(model).__name__}" + (" (auto stands alone: [auto])"
                                                 if entry == AUTO else "")
                    + f". Classes that repeat: {repeating_classes(model)}. Module names (globs "
                    f"such as 'layer*.*' match them): {module_names(model)}")
            names += matched
        exact = [entry for entry in spec if entry in modules]
        for name in exact:
            inside = [other for other in exact if name.startswith(other + ".")]
            if inside:
                raise ValueError(f"{key}: {name!r} is inside {inside[0]!r}; name each region "
                                 "once")
        order = {name: index for index, name in enumerate(modules)}
        names = outermost(sorted(set(names), key=order.__getitem__))
    return Blocks(names, [modules[name] for name in names])


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` was (its parent's attribute or list slot)."""
    parent, _, attribute = name.rpartition(".")
    model.get_submodule(parent).register_module(attribute, new)


def whole_sequential(model: nn.Module, blocks: Blocks, key: str) -> str:
    """The name of the nn.Sequential whose children are exactly `blocks`; a refusal otherwise."""
    parents = list(dict.fromkeys(name.rpartition(".")[0] for name in blocks.names))
    container = model.get_submodule(parents[0]) if len(parents) == 1 else None
    if isinstance(container, nn.Sequential) and len(container) == len(blocks.names):
        return parents[0]
    if len(parents) > 1:
        found = f"spread over {len(parents)} containers ({', '.join(parents[:4])})"
    elif isinstance(container, nn.Sequential):
        found = f"only {len(blocks.names)} of the {len(container)} modules of {parents[0]!r}"
    else:
        found = (f"in {parents[0] or 'the model'!r}, an {type(container).__name__} that the "
                 "model's own forward loops over")
    raise ValueError(
        f"checkpointing=sequential cuts one nn.Sequential that forward calls whole into "
        f"segments; the blocks ({blocks.describe()}, from {key}) are {found}. Use "
        "checkpointing=full or selective, which wrap each block in place")
