"""One registry (memexp.registry): the groups and their options are found in conf/ and the
classes it names, and every list of them reads it; and the import graph of src/ has no circle,
counting the imports inside functions too."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from memexp import registry
from memexp.baseline import BASELINE_GROUPS
from memexp.result import GROUPS
from memexp.techniques.optim import Adam

from conftest import REPO

SRC = REPO / "src"


def test_the_lists_of_groups_and_options_are_read_from_the_classes():
    assert GROUPS == ("precision", "checkpointing", "optim", "parallel", "bn_mode", "adapter",
                      "compile")
    # `baseline = True`
    assert BASELINE_GROUPS == ("precision", "checkpointing", "bn_mode", "adapter", "compile")
    assert {group: registry.planned(group) for group in ("precision", "checkpointing",
                                                         "bn_mode", "adapter")} == {
        "precision": ["fp32", "amp", "bf16", "bf16_pure", "float8"],
        "checkpointing": ["none", "full", "full_offload", "offload", "selective_ops"],
        "bn_mode": ["train", "efficient_eval"],
        "adapter": ["none", "lora", "qlora"]}
    assert [name for lighter in Adam.lighter
            for name in registry.options_of("optim", lighter)] == [
                "adafactor", "adamw_8bit", "adamw_4bit", "adamw_fp8", "muon"]


@pytest.fixture
def conf_copy(tmp_path, monkeypatch) -> Path:
    """conf/ copied, for the registry to read instead (its caches emptied before and after)."""
    copy = tmp_path / "conf"
    shutil.copytree(registry.config_dir(), copy)
    cached = (registry.options, registry.groups, registry.targets, registry.techniques)
    for function in cached:
        function.cache_clear()
    monkeypatch.setattr(registry, "config_dir", lambda: copy)
    yield copy
    for function in cached:
        function.cache_clear()


def test_a_new_option_is_one_yaml_file_that_every_list_then_has(conf_copy):
    (conf_copy / "precision" / "bf16_again.yaml").write_text(
        "defaults:\n  - /schema/precision/Autocast@_here_\n  - _self_\n\n"
        "_target_: memexp.techniques.precision.Autocast\ndtype: bfloat16\n")
    assert "bf16_again" in registry.options("precision")
    assert "bf16_again" in registry.planned("precision")  # Autocast's `planned`: all of them
    assert registry.techniques() == GROUPS


def imported(path: Path, module: str) -> set[str]:
    """The modules of src/ that `path` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name in MODULES and name != module}


MODULES = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
           for p in SRC.rglob("*.py")}


def test_the_import_graph_of_src_has_no_circle():
    graph = {}
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = imported(path, module)
    circles, state = [], {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                circles.append(trail[trail.index(other):] + [other])
            elif other not in state:
                visit(other, [*trail, other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)
