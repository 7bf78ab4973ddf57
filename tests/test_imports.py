"""The package layering: every import, at module level or inside a function, points down the stack.

A unit is a package of expertstream/ or one of its top-level modules. A unit imports itself or a unit of a
lower layer, never one of its own layer or above, so the graph between units has no cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import expertstream

ROOT = Path(next(iter(expertstream.__path__)))  # a namespace package: no __init__.py
# lowest first
LAYERS = [
    {"log"},
    {"config", "sampling", "tokenizer", "memory_plan"},  # leaves every layer may use
    {"generate"},  # the generator API: SamplingParams and stream_generate over any engine
    {"formats"},  # the on-disk tensor formats
    {"kernels"},  # Triton kernels and their PyTorch twins
    {"workdir", "synth"},  # the working directory (format, setup, verify); synthetic checkpoints
    {"store"},  # expert blocks and PLE rows read from the working directory
    {"models"},  # the network and its per-conversation state
    {"experts"},  # the expert banks
    {"runtime"},  # the engine, decode graphs and the generation worker
    {"default_model"},
    {"commands", "server"},
    {"bench"},  # measures the engine and compares with `check`'s reference
    {"cli"},
    {"__main__"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str) -> str:
    """expertstream.a.b -> a (a package) or the top-level module's name."""
    return module.split(".")[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """The expertstream modules (or names in them) that `module`'s source imports, wherever in the file."""
    package = module if is_package else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if base == "expertstream":  # from expertstream import x: x is the unit
                out |= {f"expertstream.{a.name}" for a in node.names}
            else:
                out.add(base)
    return {m for m in out if m.startswith("expertstream.")}


def edges() -> list[tuple[str, str, str]]:
    """(importing file, importer's unit, imported unit) for every import between two units."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        src = unit_of(module_name(path)) if module_name(path) != "expertstream" else None
        for m in imports_of(path.read_text(), module_name(path), path.name == "__init__.py"):
            dst = unit_of(m)
            if src is not None and dst != src:
                out.append((str(path.relative_to(ROOT.parent)), src, dst))
    return out


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(p)) for p in ROOT.rglob("*.py") if module_name(p) != "expertstream"}
    assert units - set(RANK) == set(), "a new package or top-level module: give it a layer in LAYERS"


def test_imports_only_point_down():
    upward = [f"{f}: {a} imports {b}" for f, a, b in edges() if RANK[b] >= RANK[a]]
    assert upward == []


def test_the_check_sees_lazy_and_relative_imports():
    src = "def g():\n    from expertstream.runtime.engine import Engine\n    from ..bench import cli\n"
    src += "from expertstream import server\nfrom . import base\n"
    found = imports_of(src, "expertstream.models.qwen4_exp")
    assert found == {
        "expertstream.runtime.engine",
        "expertstream.bench",
        "expertstream.server",
        "expertstream.models",
    }
