"""`servelm bench` end to end against real HTTP servers over the fake runner: its JSON, figure and ratio table."""

from __future__ import annotations

import json

import pytest

from servelm.__main__ import main

ROOMY = {"context_window": 8192, "max_step_tokens": 512}  # the fake model reads a token a byte

KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
        "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
        "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
        "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms", "input_lens", "output_lens",
        "ttfts", "itls", "generated_texts", "errors", "max_concurrency", "request_rate", "num_prompts", "model_id",
        "date", "max_output_tokens_per_s", "max_concurrent_requests")


def test_compare_two_servers_writes_json_png_and_ratios(fake_server_factory, tmp_path, capsys):
    a, b = fake_server_factory(**ROOMY), fake_server_factory(**ROOMY)
    rc = main(["bench", "--url", a.base_url, "--compare", b.base_url + "/v1", "--num-prompts", "6",
               "--max-concurrency", "1,3", "--random-input-len", "24", "--random-output-len", "8", "--ignore-eos",
               "--goodput", "ttft:60000", "tpot:60000", "--result-dir", str(tmp_path), "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0
    slots = ROOMY.get("num_slots", 4)
    assert (f"{slots} slots for at most 3 streams: equal footing" if slots >= 3 else "NOT equal footing") in out
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 4  # two servers × two levels
    for f in files:
        res = json.loads(f.read_text())
        assert set(KEYS) <= set(res), set(KEYS) - set(res)
        assert res["completed"] == 6 and res["failed"] == 0
        assert res["output_lens"] == [8] * 6  # ignore_eos: every answer runs to its max tokens
        assert res["total_output_tokens"] == 48
        assert res["request_goodput"] == pytest.approx(res["request_throughput"])  # generous SLOs: all good
        assert res["max_concurrent_requests"] <= res["max_concurrency"]
        assert res["request_rate"] == "inf" and res["model_id"] == "fake-model"
        assert all(t > 0 for t in res["ttfts"]) and all(len(g) == 7 for g in res["itls"])
    assert {json.loads(f.read_text())["max_concurrency"] for f in files} == {1, 3}
    pngs = list(tmp_path.glob("*.png"))
    assert len(pngs) == 1 and pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    host_a, host_b = a.base_url.split("://")[1], b.base_url.split("://")[1]
    assert f"| metric | max concurrency | {host_a} | {host_b} | {host_a} ÷ {host_b} |" in out
    assert "| output_throughput | 3 |" in out and "| median_ttft_ms | 1 |" in out
    assert out.count("Serving Benchmark Result") == 4 and "Request goodput (req/s):" in out
    assert "Median TPOT (ms):" in out and "P90 ITL (ms):" in out


def test_levels_send_fresh_prompts_and_a_warmup_of_its_own(fake_server_factory, tmp_path):
    """The same prompt in two levels (or in the warm-up) would be read from a server's prefix cache."""
    s = fake_server_factory(**ROOMY)
    seen: list[str] = []
    original = s.runner.step

    def spy(plan):
        for chunk in plan.chunks:
            if chunk.start == 0:
                seen.append(repr(s.engine.scheduler.sequence(chunk.seq).group.prompt_token_ids))
        return original(plan)

    s.runner.step = spy
    assert main(["bench", "--url", s.base_url, "--num-prompts", "4", "--max-concurrency", "1,2", "--num-warmups", "1",
                 "--random-input-len", "16", "--random-output-len", "4", "--result-dir", str(tmp_path),
                 "--disable-tqdm", "--no-plot"]) == 0
    assert len(seen) == 10 and len(set(seen)) == 10  # 2 warm-ups + 2 × 4 requests, no prompt twice
    assert not list(tmp_path.glob("*.png"))


def test_request_rate_sweep_and_a_named_workload(fake_server_factory, tmp_path, capsys):
    s = fake_server_factory(**ROOMY)
    assert main(["bench", "--url", s.base_url, "--dataset-name", "multi-turn-4", "--num-prompts", "2",
                 "--request-rate", "50,100", "--result-filename", "ignored-for-sweeps.json",
                 "--result-dir", str(tmp_path), "--disable-tqdm"]) == 0
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 2
    for f in files:
        res = json.loads(f.read_text())
        assert res["request_rate"] in (50.0, 100.0) and res["max_concurrency"] == 4  # the workload's own
        assert res["completed"] == 2 * 4  # two conversations of four turns, each turn a request
        assert res["dataset_name"] == "multi-turn-4"
    assert len(list(tmp_path.glob("*.png"))) == 1


def test_fixed_prompt_set_and_result_filename(fake_server_factory, tmp_path):
    s = fake_server_factory(**ROOMY)
    assert main(["bench", "--url", s.base_url, "--dataset-name", "fixed", "--num-prompts", "3", "--fixed-input-len",
                 "120", "--fixed-output-len", "5", "--result-filename", "one.json", "--result-dir", str(tmp_path),
                 "--disable-tqdm", "--no-plot"]) == 0
    res = json.loads((tmp_path / "one.json").read_text())
    assert res["completed"] == 3
    assert all(n >= 100 for n in res["input_lens"])  # the packaged passage's lines, about 120 tokens a prompt


@pytest.mark.parametrize("argv, message", [
    (["--goodput", "ttft"], "goodput SLO"),
    (["--percentile-metrics", "ttft,latency"], "--percentile-metrics latency"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
])
def test_bad_arguments_are_named(argv, message, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--url", "http://127.0.0.1:9", "--result-dir", str(tmp_path), *argv])
    assert message in str(info.value)


def test_an_unreachable_server_is_a_clear_exit(tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--url", "http://127.0.0.1:9", "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert "/v1/models" in str(info.value) and "--model" in str(info.value)


def test_a_peer_with_fewer_slots_than_streams_is_not_on_equal_footing():
    from servelm.bench.cli import footing

    lines = footing(["servelm", "llama-server"], {"servelm": 16, "llama-server": 4}, [1, 16])
    assert lines[0] == "- servelm: 16 slots for at most 16 streams: equal footing"
    assert "NOT equal footing, 12 of its requests queue" in lines[1] and "-np 16" in lines[1]
    assert "not reported" in footing(["vllm"], {"vllm": None}, [8])[0]
