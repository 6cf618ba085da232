"""Attack on harness.asgi_floor: a run killed mid-measure (a plain kill, or Ctrl-C) leaves neither its server nor
its spinning processes behind."""

import signal
import subprocess
import sys
import time

import pytest

from harness.procfs import tree


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_killed_run_leaves_no_server_or_spinner_behind(sig: signal.Signals) -> None:
    run = subprocess.Popen([sys.executable, "-m", "harness.asgi_floor", "--burn", "2", "--rounds", "50", "--chunks",
                            "200", "--period", "0.01"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    children: list[int] = []
    deadline = time.monotonic() + 30
    while len(children) < 3 and time.monotonic() < deadline:  # the server and two spinners
        time.sleep(0.2)
        children = tree(run.pid)[1:]
    assert len(children) >= 3, "the run started its server and spinners"
    run.send_signal(sig)
    _, err = run.communicate(timeout=20)
    assert run.returncode == 130 and b"Traceback" not in err
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
