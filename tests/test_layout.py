"""The house: every module in its layer, imports one way, no module patching another, each room a readable size.

Read from the source files (ast), not by importing them: a layer is a promise about what a module may import, so
that a reader of the method never has to read the plumbing, and the plumbing never depends on the method.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A module may import only modules of a lower layer (docs/design.md's map). The trainers and the study's tools
# sit on top; the trainers never import each other; the preflight, a layer above them, imports the trainer its
# command names (its Args and CPU preset).
LAYERS = [
    ["plumbing.errors", "plumbing.threads", "intervals", "critics"],
    ["plumbing.rundir", "plumbing.rollout", "plumbing.models", "plumbing.cmdline"],
    ["plumbing.distributed"],
    ["plumbing.runtime", "plumbing.forward"],
    ["plumbing.logs", "plumbing.checkpoint", "plumbing.static_kernels"],
    ["plumbing.static_engine"],
    ["plumbing.generation"],
    ["common"],
    ["gsm8k"],
    ["measure"],
    ["ppo", "grpo", "dpo", "organism", "read_runs", "sweep_runner"],
    ["preflight", "plots", "estimate"],
    ["report"],
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# sweep.sh starts before any trainer; the scripts import plumbing.threads before torch (its wait policy)
NO_TORCH = ["plumbing.errors", "plumbing.threads", "plumbing.rundir", "plumbing.cmdline", "intervals", "sweep_runner"]


def modules() -> dict[str, Path]:
    found = {p.stem: p for p in ROOT.glob("*.py")}
    found |= {f"plumbing.{p.stem}": p for p in (ROOT / "plumbing").glob("*.py") if p.stem != "__init__"}
    return found


def project_imports(path: Path) -> set[str]:
    """The project modules a file imports, anywhere in it (a function's own import counts too)."""
    names = set(modules())
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "plumbing":
                out |= {f"plumbing.{a.name}" for a in node.names}
            elif node.module in names:
                out.add(node.module)
    return out


def test_every_module_has_a_layer():
    assert sorted(modules()) == sorted(LAYER), (
        "a module was added or removed: give it a layer here and in docs/design.md"
    )


@pytest.mark.parametrize("name", sorted(LAYER))
def test_imports_go_one_way(name):
    below = {m for m in project_imports(modules()[name]) if LAYER[m] >= LAYER[name]}
    assert not below, f"{name} (layer {LAYER[name]}) imports {sorted(below)} of its own layer or one above it"


def test_an_import_from_above_is_caught(tmp_path):
    """The check itself can fail: a plumbing module importing the method is seen (a file of that shape)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import measure\n    from plumbing import generation\n")
    assert project_imports(bad) == {"measure", "plumbing.generation"}


def patches(path: Path) -> list[str]:
    """What a module's top level does to another module's attributes as it is imported: an assignment to one, or a
    call of one's method (the old checkpoint.py ran `runtime._RUN_FOLDER.update(...)`)."""
    text = path.read_text()
    body = ast.parse(text).body
    imported = {a.asname or a.name for n in body if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    found = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):  # running, not importing
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign):
                targets = sub.targets
            elif isinstance(sub, ast.AugAssign):
                targets = [sub.target]
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):  # module.attr.method(...)
                targets = [sub.func.value] if isinstance(sub.func.value, ast.Attribute | ast.Subscript) else []
            else:
                continue
            for target in targets:
                while isinstance(target, ast.Attribute | ast.Subscript):
                    target = target.value
                if isinstance(target, ast.Name) and target.id in imported and target.id not in ("os", "sys", "torch"):
                    found.append(ast.get_source_segment(text, sub))
    return found


@pytest.mark.parametrize("name", sorted(LAYER))
def test_no_module_patches_another_when_imported(name):
    assert not patches(modules()[name]), f"{name} changes another module as it is imported: {patches(modules()[name])}"


def test_a_patch_on_import_is_caught(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import runtime\nfrom plumbing import logs\nruntime._RUN_FOLDER.update(release=None)\nlogs.X = 1\n")
    assert patches(bad) == ["runtime._RUN_FOLDER.update(release=None)", "logs.X = 1"]


def test_the_torch_free_modules_load_no_torch():
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {', '.join(NO_TORCH)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


@pytest.mark.parametrize("name", sorted(LAYER))
def test_each_room_opens_with_what_it_holds_and_stays_readable(name):
    path = modules()[name]
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc.splitlines()) >= 2, f"{path.name} opens without saying what it holds"
    lines = len(path.read_text().splitlines())
    assert lines <= 800, f"{path.relative_to(ROOT)} is {lines} lines: split it by concern"
