"""vllm bench serve's metrics on recorded timestamps whose values are worked out by hand."""

from __future__ import annotations

import math
import statistics

import pytest

from servelm.bench.loadgen import RequestResult, arrival_gaps
from servelm.bench.metrics import parse_goodput, serving_metrics


def record(start, ttft, itl, e2e, out, prompt):
    return RequestResult(ok=True, start_time=start, ttft_s=ttft, itl_s=list(itl), e2e_s=e2e, output_tokens=out,
                         prompt_tokens=prompt, text="x" * out)


# A: 4 tokens, first at 0.1 s, gaps 20/30/50 ms, done at 0.2 s      → TPOT (0.2 − 0.1) / 3 = 33.33 ms
# B: 2 tokens, first at 0.3 s, one gap of 100 ms, done at 0.5 s      → TPOT (0.5 − 0.3) / 1 = 200 ms
# C: failed
# D: 1 token at 0.2 s, done at 0.2 s (starts at 1.2 s)              → no TPOT (counts as 0 for goodput)
RECORDS = [
    record(0.0, 0.1, [0.02, 0.03, 0.05], 0.2, 4, 10),
    record(0.05, 0.3, [0.1], 0.5, 2, 20),
    RequestResult(ok=False, start_time=0.1, e2e_s=0.01, error="HTTP 500: boom"),
    record(1.2, 0.2, [], 0.2, 1, 5),
]


def test_totals_and_throughputs():
    m = serving_metrics(RECORDS, 2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 35, 7)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(21.0)
    assert m["request_goodput"] is None  # no SLOs given
    assert m["duration"] == 2.0


def test_ttft_tpot_itl_e2el_statistics():
    m = serving_metrics(RECORDS, 2.0, percentiles=(90, 99))
    # TTFT 100, 300, 200 ms
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert m["p90_ttft_ms"] == pytest.approx(280)  # linear: 200 + 0.8 × 100
    assert m["p99_ttft_ms"] == pytest.approx(298)
    # TPOT 33.33 and 200 ms (D has one token: none)
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 200) / 2)
    assert m["median_tpot_ms"] == pytest.approx((100 / 3 + 200) / 2)
    assert m["p99_tpot_ms"] == pytest.approx(100 / 3 + 0.99 * (200 - 100 / 3))
    # ITL pooled: 20, 30, 50, 100 ms
    assert m["mean_itl_ms"] == pytest.approx(50)
    assert m["median_itl_ms"] == pytest.approx(40)
    assert m["p90_itl_ms"] == pytest.approx(85)  # 50 + 0.7 × 50
    # E2EL 200, 500, 200 ms
    assert m["mean_e2el_ms"] == pytest.approx(300)
    assert m["median_e2el_ms"] == pytest.approx(200)
    assert m["p99_e2el_ms"] == pytest.approx(494)  # 200 + 0.98 × 300


def test_goodput_counts_requests_within_every_slo():
    # A meets both; B's TTFT of 300 ms misses 250; D's TTFT of 200 ms passes and its TPOT counts as 0
    m = serving_metrics(RECORDS, 2.0, goodput=parse_goodput(["ttft:250", "tpot:100"]))
    assert m["request_goodput"] == pytest.approx(1.0)  # 2 good requests / 2 s
    m = serving_metrics(RECORDS, 2.0, goodput=parse_goodput(["e2el:300"]))
    assert m["request_goodput"] == pytest.approx(1.0)  # A and D
    m = serving_metrics(RECORDS, 2.0, goodput=parse_goodput(["tpot:30"]))
    assert m["request_goodput"] == pytest.approx(0.5)  # D alone (A's 33 ms misses)


def test_peaks_per_second_and_in_flight():
    m = serving_metrics(RECORDS, 2.0)
    # chunks at 0.1, 0.12, 0.15, 0.2 (A), 0.35, 0.45 (B) in the first second; 1.4 (D) in the second
    assert m["max_output_tokens_per_s"] == 6
    assert m["max_concurrent_requests"] == 2  # A and B overlap; D runs alone
    back_to_back = [record(0.0, 0.1, [], 0.5, 1, 1), record(0.5, 0.1, [], 0.5, 1, 1)]
    assert serving_metrics(back_to_back, 1.0)["max_concurrent_requests"] == 1  # one ends as the next starts


def test_selected_metrics_and_named_percentiles():
    m = serving_metrics(RECORDS, 2.0, percentiles=(50, 99.9), selected=("ttft",))
    assert "p50_ttft_ms" in m and "p99.9_ttft_ms" in m
    assert not any(k.endswith("_tpot_ms") or k.endswith("_itl_ms") or k.endswith("_e2el_ms") for k in m)


def test_per_request_lists_keep_every_request_in_order():
    m = serving_metrics(RECORDS, 2.0)
    assert m["input_lens"] == [10, 20, 0, 5]
    assert m["output_lens"] == [4, 2, 0, 1]
    assert m["ttfts"] == [0.1, 0.3, 0.0, 0.2]
    assert m["itls"][0] == [0.02, 0.03, 0.05] and m["itls"][2] == []
    assert m["errors"] == ["", "", "HTTP 500: boom", ""]
    assert m["start_times"] == [0.0, 0.05, 0.1, 1.2]


def test_no_successful_request_gives_zeros_not_errors():
    m = serving_metrics([RECORDS[2]], 1.0, goodput={"ttft": 100.0})
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0 and m["request_goodput"] == 0
    assert m["max_concurrent_requests"] == 0


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "itl:50", "tpot:-1", "e2el:soon", "ttft:inf"])
def test_bad_goodput_slos_are_named(bad):
    with pytest.raises(ValueError, match="goodput SLO"):
        parse_goodput([bad])


def test_arrivals_all_at_once_or_poisson_or_gamma():
    assert arrival_gaps(5, math.inf) == [0.0] * 5
    gaps = arrival_gaps(20001, 4.0, 1.0, seed=1)
    assert gaps[0] == 0.0  # the first request goes at once
    mean, sd = statistics.fmean(gaps[1:]), statistics.pstdev(gaps[1:])
    assert mean == pytest.approx(0.25, rel=0.03)
    assert sd / mean == pytest.approx(1.0, rel=0.05)  # exponential gaps: a Poisson process
    even = arrival_gaps(20001, 4.0, 4.0, seed=1)[1:]
    assert statistics.fmean(even) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(even) / statistics.fmean(even) == pytest.approx(0.5, rel=0.05)  # gamma k=4: 1/√k
    assert arrival_gaps(10, 2.0, seed=3) == arrival_gaps(10, 2.0, seed=3)
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0)
