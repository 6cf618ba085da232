"""Replica counts in the config file: what is accepted, the errors for what is not, and Ray Serve's options."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.config import load_config_file

pytestmark = pytest.mark.ray

MODEL = 'name = "chat"\nmodel = "smollm2"\n'


def config(tmp_path: Path, extra: str):
    path = tmp_path / "servelm.toml"
    path.write_text(f"[[deployments]]\n{MODEL}{extra}")
    return load_config_file(path).deployments[0]


@pytest.mark.parametrize("extra, message", [
    ("num_replicas = 2\nmax_replicas = 3\n", "either num_replicas or min_replicas/max_replicas"),
    ("min_replicas = 2\n", "min_replicas needs max_replicas"),
    ("min_replicas = 4\nmax_replicas = 2\n", "min_replicas (4) is above max_replicas (2)"),
    ("num_replicas = 0\n", "num_replicas"),
    ("max_replicas = 0\n", "max_replicas"),
])
def test_bad_replica_counts_name_the_problem(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        config(tmp_path, extra)
    assert message in str(caught.value) and "servelm.toml" in str(caught.value)


def test_fixed_replicas(tmp_path: Path) -> None:
    from servelm.ray.application import deployment_options

    spec = config(tmp_path, "num_replicas = 3\n[deployments.engine]\nthreads = 2\nmax_num_seqs = 8\n")
    options = deployment_options(spec)
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 2}
    assert options["max_ongoing_requests"] >= 8
    assert options["request_router_config"].request_router_kwargs["imbalance"] >= 1


def test_autoscaled_replicas(tmp_path: Path) -> None:
    from servelm.ray.application import deployment_options

    spec = config(tmp_path, "min_replicas = 0\nmax_replicas = 4\n")
    scaling = deployment_options(spec)["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (0, 4, 1)
    assert "num_replicas" not in deployment_options(spec)


def test_one_replica_by_default(tmp_path: Path) -> None:
    from servelm.ray.application import deployment_options

    assert deployment_options(config(tmp_path, ""))["num_replicas"] == 1


def test_serve_has_the_ray_flags(capsys: pytest.CaptureFixture) -> None:
    from servelm.__main__ import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert "--ray " in text and "--ray-address" in text
