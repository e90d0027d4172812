"""The command `python report.py ...`: the sweep's report, each run's curves, the sweep's estimates.

The report itself lives in study/report.py (with what it reads, draws and estimates: study/); this file only keeps
the command that users and the docs type, `python report.py OUT`, at the repository's root. Its --help says the rest.
"""

from plumbing import runtime
from study.report import main

if __name__ == "__main__":
    runtime.run_main(main)
