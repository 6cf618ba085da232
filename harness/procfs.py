"""What /proc says about a process tree and the machine: resident memory and CPU time.

Used to report each server's peak memory and how much CPU *other* work took while it was measured
(the machine is shared; a busy neighbour slows llama.cpp's spinning thread pool a lot).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids += [int(x) for x in fh.read().split()]
    except OSError:
        pass
    return kids


def tree(pid: int) -> list[int]:
    """A process and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo += _children(p)
    return out


def status_kib(pid: int, key: str) -> int:
    """A `kB` field of /proc/PID/status (VmRSS, VmHWM, ...), 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_rss_kib(pid: int) -> int:
    """Summed VmRSS of a process and all its descendants, in KiB."""
    return sum(status_kib(p, "VmRSS") for p in tree(pid))


def _stat_cpu_s(path: str) -> float:
    """User + system CPU seconds from a /proc stat file, 0 if it is gone."""
    try:
        with open(path) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads), 0 if it is gone."""
    return _stat_cpu_s(f"/proc/{pid}/stat")


def thread_cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of one thread of a process (its main thread by default), 0 if it is gone."""
    return _stat_cpu_s(f"/proc/{pid}/task/{tid or pid}/stat")


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (not idle or iowait)."""
    with open("/proc/stat") as fh:
        values = [int(x) for x in fh.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / CLK_TCK


@dataclass
class CpuSnapshot:
    wall: float
    machine: float
    server: float
    me: float

    @classmethod
    def take(cls, server_pid: int) -> CpuSnapshot:
        me = os.times()
        return cls(time.monotonic(), machine_busy_s(), sum(cpu_s(p) for p in tree(server_pid)),
                   me.user + me.system)


def other_cores(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """Average number of cores busy with neither the server nor this process between two snapshots."""
    wall = after.wall - before.wall
    if wall <= 0:
        return 0.0
    other = (after.machine - before.machine) - (after.server - before.server) - (after.me - before.me)
    return max(0.0, other / wall)


def other_cores_now(interval_s: float = 1.0) -> float:
    """Average number of cores busy with work other than this process over the next `interval_s`."""
    me0, busy0, t0 = os.times(), machine_busy_s(), time.monotonic()
    time.sleep(interval_s)
    me1, busy1, t1 = os.times(), machine_busy_s(), time.monotonic()
    mine = (me1.user + me1.system) - (me0.user + me0.system)
    return max(0.0, (busy1 - busy0 - mine) / (t1 - t0))
