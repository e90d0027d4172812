"""The house: every module in its layer, imports one way, no module patching another, each room a readable size, and a
root that shows the method (the study's machinery in study/, the root at most MAX_ROOT Python files).

Read from the source files (ast), not by importing them: a layer is a promise about what a module may import, so
that a reader of the method never has to read the plumbing or the study, and neither the plumbing nor the method
depends on the study.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A module may import only modules of a lower layer (docs/design.md's map). The trainers and the study's tools
# (study/) sit on top; the trainers never import each other; the preflight, a layer above them, imports the trainer
# its command names (its Args and CPU preset). The root's report.py is the command `python report.py`: study/report.py's
# entry point, the one module outside study/ that imports it.
LAYERS = [
    ["plumbing.errors", "plumbing.threads", "intervals", "study.readout"],
    ["plumbing.rundir", "plumbing.rollout", "plumbing.cmdline"],
    ["plumbing.models"],
    ["plumbing.distributed"],
    ["plumbing.runtime", "plumbing.forward"],
    ["plumbing.logs", "plumbing.checkpoint", "plumbing.static_kernels"],
    ["plumbing.static_engine"],
    ["plumbing.generation"],
    ["common", "critics"],
    ["gsm8k"],
    ["measure", "study.sweep_help", "study.twins"],
    ["ppo", "grpo", "dpo", "organism", "study.read_runs", "study.sweep_runner", "study.pretrain_critic"],
    ["study.preflight", "study.plots", "study.estimate", "study.crossover"],
    ["study.moves"],
    ["study.report"],
    ["report"],
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# sweep.sh starts before any trainer; the scripts import plumbing.threads before torch (its wait policy)
NO_TORCH = [
    "plumbing.errors",
    "plumbing.threads",
    "plumbing.rundir",
    "plumbing.cmdline",
    "intervals",
    "study.sweep_runner",
    "study.sweep_help",
    "study.twins",
]
ENTRY_POINTS = {"report": "study.report"}  # a command at the root -> the study module whose main it runs
MAX_ROOT = 10  # Python files at the root: the trainers, the modules they import, the organism's recipe, the commands
PACKAGES = ("plumbing", "study")


def modules() -> dict[str, Path]:
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for package in PACKAGES:
        found |= {f"{package}.{p.stem}": p for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}
    return found


def project_imports(path: Path) -> set[str]:
    """The project modules a file imports, anywhere in it (a function's own import counts too)."""
    names = set(modules())
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in PACKAGES:  # from study import report
                out |= {f"{node.module}.{a.name}" for a in node.names}
            elif node.module in names:  # from study.read_runs import finite
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
    bad.write_text(
        "import study.plots\nfrom study.read_runs import finite\n"
        "def f():\n    import measure\n    from plumbing import generation\n    from study import report\n"
    )
    assert project_imports(bad) == {"measure", "plumbing.generation", "study.plots", "study.read_runs", "study.report"}


def test_the_method_never_imports_the_study():
    """No module outside study/ imports it, the root's commands aside: the trainers, the modules they import and the
    plumbing read the same with study/ deleted."""
    found = {
        name: sorted(m for m in project_imports(path) if m.startswith("study."))
        for name, path in modules().items()
        if not name.startswith("study.") and name not in ENTRY_POINTS
    }
    importing = {name: study for name, study in found.items() if study}
    assert not importing, f"the method imports the study: {importing}"


def test_the_root_shows_the_method():
    """The root holds the trainers, the modules they import, the organism's recipe and the commands a user types: at
    most MAX_ROOT Python files; the study's machinery lives in study/, which says what it holds."""
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= MAX_ROOT, f"{len(root)} Python files at the root ({' '.join(root)}): the study's go in study/"
    doc = ast.get_docstring(ast.parse((ROOT / "study" / "__init__.py").read_text()))
    assert doc and len(doc.splitlines()) >= 2, "study/__init__.py opens without saying what the folder holds"


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_a_command_at_the_root_only_runs_the_study_modules_main(name):
    """report.py at the root keeps `python report.py` as users and the docs type it: its docstring, the imports of
    the study module's main and of runtime, and the call; no code of its own (that is the study module's)."""
    body = ast.parse(modules()[name].read_text()).body
    assert ast.get_docstring(ast.Module(body=body, type_ignores=[])), f"{name}.py opens without its docstring"
    code = [n for n in body[1:] if not isinstance(n, ast.Import | ast.ImportFrom)]
    assert len(code) == 1 and isinstance(code[0], ast.If) and "__main__" in ast.unparse(code[0].test), (
        f"{name}.py holds code of its own: it belongs in {ENTRY_POINTS[name].replace('.', '/')}.py"
    )
    imported = [n for n in body if isinstance(n, ast.ImportFrom) and n.module == ENTRY_POINTS[name]]
    assert [a.name for n in imported for a in n.names] == ["main"] and "main" in ast.unparse(code[0])


def test_the_map_in_design_md_names_every_module():
    """docs/design.md's map (its first code block) names every module's file, so that a module added or moved is
    drawn there too."""
    text = (ROOT / "docs" / "design.md").read_text()
    drawn = text.split("## The map", 1)[1].split("```", 2)[1]
    missing = [f"{name}.py" for name in sorted(modules()) if f"{name.rsplit('.', 1)[-1]}.py" not in drawn]
    assert not missing, f"docs/design.md's map does not name {missing}"
    assert "study/" in drawn and "plumbing/" in drawn


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
