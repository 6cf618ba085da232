"""harness.asgi_floor: the bare ASGI stream it measures delivers every chunk, and the loop's CPU is read from it."""

import signal
import subprocess
import sys
import time

import pytest

from harness.asgi_floor import main, measure
from harness.procfs import tree


def test_every_chunk_arrives_and_the_loops_cpu_is_counted() -> None:
    rows = measure(chunks=40, period=0.0, rounds=2, burn=1)
    assert [row["chunks"] for row in rows] == [40, 40]
    assert all(row["loop_ms"] > 0 and row["process_ms"] >= 0 for row in rows)


@pytest.mark.parametrize("argv", [["--chunks", "0"], ["--chunks", "100001"], ["--period", "2"], ["--rounds", "0"],
                                  ["--rounds", "101"], ["--burn", "-1"], ["--burn", "65"]])
def test_out_of_bound_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


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
