"""The clocks the BLAS thread controller (``threads.py``) times a step with: wall time, this
process's CPU time, and the machine's busy CPU from ``/proc/stat``."""

from __future__ import annotations

import os
import time


class MachineClock:
    """The clocks a step is timed with: wall, this process's CPU, and the machine's busy CPU
    (``/proc/stat``: all but idle and iowait, in seconds over every core; None where there
    is none, or where it counts more cores than this process may run on — a container's view
    of a larger host says nothing about our cores)."""

    def __init__(self) -> None:
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._stat = self.busy() is not None and self._host_cores() == self.cores

    def wall(self) -> float:
        return time.perf_counter()

    def cpu(self) -> float:
        return time.process_time()

    def busy(self) -> float | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):  # not Linux, or a /proc we cannot read: no signal
            return None
        if len(fields) < 5:
            return None
        return (sum(fields) - fields[3] - fields[4]) / self._hz

    def machine_busy(self) -> float | None:
        return self.busy() if self._stat else None

    @staticmethod
    def _host_cores() -> int:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                return sum(1 for line in f if line.startswith("cpu") and line[3].isdigit())
        except OSError:
            return 0
