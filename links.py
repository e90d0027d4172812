"""Symbolic links in a run's or a sweep's folder: where the first one is.

Holds one pure function and imports no torch, so that sweep_runner.py (which loads nothing heavy before its
options are good) and checkpoint.py look for links the same way. It refuses nothing itself: each caller says
its own one-line error. Not here: opening files without following links (checkpoint.open_nofollow).
"""

from __future__ import annotations

import os
from pathlib import Path


def first_link(folder: Path) -> tuple[Path, str] | None:
    """(path, target) of the folder itself if it is a symbolic link, else of the first link under it; None when
    there is none (or no folder). os.walk lists a link as a name and never follows it."""
    folder = Path(folder)
    if folder.is_symlink():
        return folder, os.readlink(folder)
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            if p.is_symlink():
                return p, os.readlink(p)
    return None
