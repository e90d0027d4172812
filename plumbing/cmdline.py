"""The command line read with tyro, its refusals one line. No torch: study/sweep_runner.py uses it before a trainer.

Holds: parse (tyro with a given instance as its defaults; a bad flag or value a UserError of one line, not tyro's box),
parse_args (the same with the class's own defaults), help_opening and fill (--help's first paragraph, any paragraph),
tyro_message (tyro's error box as one line), flag_value and given_fields (what the flags say before tyro parses them),
trainer_flags and foreign_flags (a flag one trainer lacks and another has: named as the other's), trainer_default and
script_defaults (a script's Args defaults read from its source).
Does not hold: the trainers' two presets and the device they depend on (runtime.cli), any script's Args. Imports
errors only: the trainers' flags are read from their source files (ast), never imported.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import io
import re
import shutil
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from plumbing.errors import UserError

T = TypeVar("T")


def flag_value(flags: Sequence[str], name: str, default: Any) -> Any:
    """The value of one flag as tyro (argparse) will read it, before it parses: `--name value` or `--name=value`,
    in dashes or underscores, the last one given; `default` when it is absent. The value is not checked here."""
    spellings = {"--" + name, "--" + name.replace("_", "-")}
    value = default
    for i, flag in enumerate(flags):
        key, eq, after = flag.partition("=")
        if key in spellings:
            value = after if eq else (flags[i + 1] if i + 1 < len(flags) else value)
    return value


def given_fields(cls: type, flags: Sequence[str]) -> set[str]:
    """The fields of cls that the flags set, in any spelling tyro takes (`--batch-size 8`, `--batch_size=8`,
    `--no-progress`). A value never starts with `--` (argparse refuses one), so every such token is a flag."""
    names = {f.name for f in dataclasses.fields(cls)}
    given = set()
    for flag in flags:
        if not flag.startswith("--"):
            continue
        key = flag[2:].partition("=")[0].replace("-", "_")
        if key in names:
            given.add(key)
        elif key.startswith("no_") and key[3:] in names:  # a boolean's --no-x
            given.add(key[3:])
    return given


def parse(cls: type[T], default: T, args: Sequence[str] | None, **tyro_options: Any) -> T:
    """cls from the command line (args; None: sys.argv[1:]) with tyro, `default` giving every default. A bad flag
    or value is a UserError of one line (tyro's message, without its box or help hints); --help exits 0 as tyro does.
    tyro_options go to tyro.cli (prog, config, a description other than help_opening's)."""
    import tyro

    err = io.StringIO()
    tyro_options.setdefault("description", help_opening(cls))
    try:
        with contextlib.redirect_stderr(err):
            out = tyro.cli(cls, default=default, args=args, **tyro_options)
    except SystemExit as e:
        if e.code == 2:  # tyro printed an error box and exits 2: its message, as one line
            flags = list(sys.argv[1:] if args is None else args)
            raise UserError(with_foreign_flags(tyro_message(err.getvalue()), cls, flags)) from None
        sys.stderr.write(err.getvalue())
        raise
    sys.stderr.write(err.getvalue())  # tyro's warnings, if any
    return out


# The trainers, at the repository's root: a flag one of them lacks and another has is named as the other's. Their
# flags are read from their source, as this module may import none of them (nor torch, which they import).
ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ("ppo.py", "grpo.py", "dpo.py")


@functools.cache
def _trainer_fields(script: str) -> dict[str, ast.AnnAssign]:
    """The fields of a script's Args (a trainer's, organism.py's), read from its source with ast: name -> its line.
    script: a path from the project's root, or an absolute one."""
    tree = ast.parse((ROOT / script).read_text())
    args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    return {n.target.id: n for n in args.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def trainer_flags(script: str) -> frozenset[str]:
    """The fields of a trainer's Args that are flags (not tyro.conf.Suppress)."""
    return frozenset(k for k, n in _trainer_fields(script).items() if "Suppress" not in ast.unparse(n.annotation))


def script_defaults(script: str | Path) -> dict[str, Any]:
    """A script's Args defaults, {field: its literal}, read from its source (a field without a default left out), for
    a module that may not import the script (plumbing/models.py reading organism.py's). A default that is not a
    literal is a ValueError."""
    return {k: ast.literal_eval(n.value) for k, n in _trainer_fields(str(script)).items() if n.value is not None}


def trainer_default(script: str, name: str) -> Any:
    """A trainer's study default of one field (its Args's literal), for a module that may not import the trainer
    (the study's figures: GRPO's group size)."""
    value = _trainer_fields(script)[name].value
    if value is None:
        raise KeyError(f"{script}'s Args.{name} has no default")
    return ast.literal_eval(value)


def foreign_flags(cls: type, flags: Sequence[str]) -> dict[str, list[str]]:
    """The flags given that cls (a trainer's Args) has not and other trainers have: {flag as given: "ppo.py's", ...}.
    Empty for a script that is not a trainer."""
    module = sys.modules.get(cls.__module__)
    this = Path(getattr(module, "__file__", "") or "").name
    if this not in TRAINERS or (ROOT / this) != Path(module.__file__).resolve():
        return {}
    own = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, list[str]] = {}
    for flag in flags:
        if not flag.startswith("--"):
            continue
        name = flag[2:].partition("=")[0]
        key = name.replace("-", "_")
        if key in own or (key.startswith("no_") and key[3:] in own):
            continue
        owners = [f"{t}'s" for t in TRAINERS if t != this and {key, key.removeprefix("no_")} & trainer_flags(t)]
        if owners:
            out["--" + name] = owners
    return out


def with_foreign_flags(message: str, cls: type, flags: Sequence[str]) -> str:
    """tyro's one-line refusal, led by whose flags the other trainers' are ("--critic is ppo.py's flag, not
    grpo.py's"); its list of unrecognized options loses them and their values, and goes where nothing is left."""
    foreign = foreign_flags(cls, flags)
    if not foreign:
        return message
    this = Path(sys.modules[cls.__module__].__file__).name
    said = "; ".join(f"{flag} is {' and '.join(owners)} flag, not {this}'s" for flag, owners in foreign.items())
    head, _, listed = message.partition(": ")
    if head != "Unrecognized options":
        return f"{said}; {message}"
    values = {flags[i + 1] for i, f in enumerate(flags[:-1]) if f.split("=")[0] in foreign and "=" not in f}
    rest = [o for o in listed.split(", ") if o.split("=")[0] not in foreign and o not in values]
    return f"{said}; {head}: {', '.join(rest)}" if rest else said


def parse_args(cls: type[T], args: Sequence[str] | None = None) -> T:
    """A script's Args (a dataclass, its defaults cls()'s) from the command line with tyro, for a script without
    the trainers' two presets (study/report.py). A bad flag or value is a UserError of one line."""
    return parse(cls, cls(), args)


def help_opening(cls: type) -> str:
    """--help's opening: the first line of the script's docstring (what the script does), then the Args class's own
    docstring if it has one (how to call it), each wrapped at words to the terminal's width (at most 120)."""
    module = sys.modules.get(cls.__module__)
    parts = [((module.__doc__ if module else None) or "").strip().split("\n")[0]]
    own = cls.__doc__ or ""
    if not own.startswith(cls.__name__ + "("):  # not the signature dataclass writes where there is no docstring
        parts.append(" ".join(own.split()))
    return "\n\n".join(fill(p) for p in parts if p)


def fill(paragraph: str, first: str = "", hanging: str = "  ") -> str:
    """One paragraph of --help's description, wrapped at words to the terminal's width (at most 120), after `first`
    on its first line and `hanging` on the others: an indent, for tyro joins a line of the description that starts
    with a letter to the line before it."""
    width = max(40, min(shutil.get_terminal_size().columns, 120))
    return textwrap.fill(
        " ".join(paragraph.split()),
        width,
        initial_indent=first,
        subsequent_indent=hanging,
        break_long_words=False,
        break_on_hyphens=False,
    )


def tyro_message(box: str) -> str:
    """tyro's error box -> its message on one line. rich draws the box with borders and the title in the top one,
    or (no terminal features) plain: the title alone above a rule of dashes. The message is the first block of
    text after the title, up to the next rule or blank row; the details and help hints after it are left out."""
    box = re.sub(r"\x1b\[[0-9;]*m", "", box)  # colours, if any
    rows = [line.strip().strip("│").strip() for line in box.splitlines()]
    is_rule = [bool(r) and set(r) <= set("─-") for r in rows]
    blocks: list[list[str]] = [[]]
    for i, (row, rule) in enumerate(zip(rows, is_rule)):
        if rule or row[:1] in ("╭", "╰"):  # a rule, or a border (the rich title lives there)
            blocks.append([])
        elif row:
            title = not any(blocks) and i + 1 < len(rows) and is_rule[i + 1] and len(blocks) == 1
            if not title:  # the plain title: a first line right above a rule
                blocks[-1].append(row)
        elif blocks[-1]:  # a blank row ends the message: what follows details it ("Got errors: ...")
            blocks.append([])
    text = next((b for b in blocks if b), [])
    out = ""
    for piece in text:  # rich wraps at the box's width; a wrapped "." or ")" joins without a space
        out += piece if not out or piece[0] in ".,;:)]" else " " + piece
    return out or "bad command line (run with --help)"
