"""The errors a run reports in one line, and their exit codes. No torch, no project import.

UserError (bad input: one `error:` line, exit 2), NonFiniteError (exit 3), WriteFailed (exit 1), Stopped (a stop
signal honoured outside the step: exit 0) and RunFinished (--resume of a finished run: exit 0). runtime.run_main
turns each into its line and code; every module of the project raises these, none prints its own.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: reported as one line on stderr and a non-zero exit, never a traceback."""


class NonFiniteError(Exception):
    """A NaN or inf that would be trained on or saved: one line naming the step and the quantity, exit code 3."""


class WriteFailed(Exception):
    """A write that failed (a full disk, whatever library raised it): one line naming the path, exit 1."""


class Stopped(Exception):
    """A stop signal honoured outside the training loop's step end (check_stop): the run ends at once, with
    nothing after its last checkpoint kept; run_main says so in one line and exits 0, as a stop does."""


class RunFinished(Exception):
    """--resume of a run whose results.json exists: one line, exit code 0, nothing touched."""


EXIT_USAGE, EXIT_NONFINITE, EXIT_INTERRUPTED = 2, 3, 130
