"""A pytest plugin for runs on a lent machine that may be cut off: each failure's report is written to
$OUT/failures.txt as it happens (with xdist too), so that a run stopped at its time limit still says what failed.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 -m pytest -p device_failures ...
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        path = os.path.join(os.environ.get("OUT", "."), "failures.txt")
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-2500:]}\n")
