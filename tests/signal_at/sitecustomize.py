"""Fault injection for a test's subprocesses (torchrun ranks), where tests/test_faults.py's in-process wrapper
cannot reach: with PYTHONPATH=tests/signal_at, Python imports this file at start-up, and when
RLVR_SIGNAL_AT="module.function:N" is set, the process sends itself RLVR_SIGNAL_NAME (default SIGTERM) on the Nth
call of that function of the project (before the call runs), only on the rank RLVR_SIGNAL_RANK (default: every
process). The time of the signal, and of the process's normal exit, are appended to RLVR_SIGNAL_LOG ("signal <t>",
"exit <t>").
Nothing here is imported by the project itself."""

import atexit
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time

_AT = os.environ.get("RLVR_SIGNAL_AT")
_RANK = os.environ.get("RANK", "0")


def _log(what: str) -> None:
    if os.environ.get("RLVR_SIGNAL_LOG"):
        with open(os.environ["RLVR_SIGNAL_LOG"], "a") as f:
            f.write(f"{what} {time.time()}\n")


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Loads `module` as usual, then replaces module.function by a wrapper that counts its calls."""

    def __init__(self, module: str, function: str, nth: int) -> None:
        self.module, self.function, self.nth = module, function, nth

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            real, calls = getattr(module, self.function), [0]

            def wrapper(*args, **kwargs):
                calls[0] += 1
                if calls[0] == self.nth:
                    _log("signal")
                    os.kill(os.getpid(), signal.Signals[os.environ.get("RLVR_SIGNAL_NAME", "SIGTERM")])
                return real(*args, **kwargs)

            setattr(module, self.function, wrapper)

        spec.loader.exec_module = exec_module
        return spec


if _AT and _RANK == os.environ.get("RLVR_SIGNAL_RANK", _RANK):
    _target, _nth = _AT.rsplit(":", 1)
    _module, _function = _target.rsplit(".", 1)
    sys.meta_path.insert(0, _WrapOnImport(_module, _function, int(_nth)))
    atexit.register(_log, "exit")
