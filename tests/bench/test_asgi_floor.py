"""harness.asgi_floor: the bare ASGI stream it measures delivers every chunk, and the loop's CPU is read from it."""

import pytest

from harness.asgi_floor import main, measure


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
