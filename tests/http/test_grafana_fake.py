"""docs/grafana/servelm-dashboard.json: a dashboard Grafana imports as it is, over series /metrics really exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import promql_parser
import pytest

from servelm.fleet import Fleet
from servelm.http.batches import BatchConfig

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "servelm-dashboard.json"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs(d: dict) -> list[str]:
    return [t["expr"] for p in d["panels"] for t in p["targets"]]


def test_it_is_a_dashboard_grafana_imports(dashboard):
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["type"] == "query" and variables["model"]["includeAll"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dashboard["panels"]:
        assert p["type"] == "timeseries" and p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}  # no data source uid of ours
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells and max(x for x, _ in mine) < 24, p["title"]  # panels tile the 24-column grid
        cells |= mine
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["datasource"] == p["datasource"] for t in p["targets"])


def test_it_shows_what_operators_ask_for(dashboard):
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for wanted in ("requests per second", "time to first token", "inter-token latency", "end-to-end latency",
                   "tokens per second", "queue depth", "kv cache", "prefix-cache hit rate"):
        assert wanted in titles
    latency = [p for p in dashboard["panels"] if p["title"].endswith("latency") or p["title"] == "Time to first token"]
    assert len(latency) == 3
    for p in latency:
        assert [t["legendFormat"].split()[0] for t in p["targets"]] == ["p50", "p90", "p99"]


def test_every_query_parses_as_promql(dashboard):
    for expr in exprs(dashboard):
        concrete = expr.replace("$__rate_interval", "1m").replace("$model", ".*")
        promql_parser.parse(concrete)  # raises on a syntax error


def test_every_series_it_reads_is_one_metrics_exposes(fake_server_factory, tmp_path):
    # the Batch API's series too, and the models loaded on demand
    fake_server = fake_server_factory(batches=BatchConfig(str(tmp_path)), catalog=Fleet([]))
    httpx.post(fake_server.base_url + "/v1/chat/completions", timeout=10,
               json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    text = httpx.get(fake_server.base_url + "/metrics").text
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    # a labelled counter no request has touched yet (content filtered) is declared, with no sample so far
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        exposed |= {name + "_bucket", name + "_sum", name + "_count"} if kind == "histogram" else {name}
    read = {name for e in exprs(json.loads(DASHBOARD.read_text())) for name in re.findall(r"\bservelm_[a-z0-9_]+", e)}
    assert read and read <= exposed, read - exposed
