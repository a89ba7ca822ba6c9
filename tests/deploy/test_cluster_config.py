"""cluster/raykv-gpu.yaml against the cluster-launcher schema shipped inside `ray`."""

import copy
import json
import shlex
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "cluster" / "raykv-gpu.yaml"
SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_config_matches_ray_schema(config, validator):
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(config)]
    assert errors == []


def test_misspelled_key_is_rejected(config, validator):
    bad = copy.deepcopy(config)
    bad["available_node_types"]["gpu_worker"]["max_worker"] = 4
    messages = [e.message for e in validator.iter_errors(bad)]
    assert any("max_worker" in m for m in messages), messages


def test_head_has_no_gpus_and_workers_do(config):
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"]["GPU"] == 0
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert len(workers) == 1
    assert workers[0]["resources"]["GPU"] >= 1
    assert workers[0]["max_workers"] >= workers[0]["min_workers"] >= 0


def test_setup_installs_raykv_and_torch(config):
    setup = " ".join(config["setup_commands"])
    assert "raykv" in setup
    assert "torch" in setup
    assert f"ray[default]=={ray.__version__}" in setup


def test_head_starts_raykv_after_ray_and_every_node_exports_metrics(config):
    head = config["head_start_ray_commands"]
    starts = [i for i, c in enumerate(head) if "ray start --head" in c]
    ups = [i for i, c in enumerate(head) if c.startswith("raykv up")]
    assert starts and ups and starts[0] < ups[0]
    assert "--address" in head[ups[0]]
    assert "--cpu-mem" in head[ups[0]]
    for cmd in (head[starts[0]], " ".join(config["worker_start_ray_commands"])):
        assert "--metrics-export-port=8080" in cmd


def test_setup_installs_the_wheel_built_from_this_checkout(config):
    """raykv is not on a package index: nodes install the wheel `pip wheel . -w dist` builds,
    copied to them by file_mounts (the wheel carries the CUDA kernel sources)."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    wheel = f"raykv-{version}-py3-none-any.whl"
    argv = [a for c in config["setup_commands"] for a in shlex.split(c)]
    assert "raykv" not in argv  # no install by name from an index
    (installed,) = [Path(a) for a in argv if a.endswith(".whl")]
    assert installed.name == wheel
    mounts = {Path(remote): local for remote, local in config["file_mounts"].items()}
    assert installed.parent in mounts
    assert Path(mounts[installed.parent]) == Path("dist")
