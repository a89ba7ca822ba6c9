"""The raykv image (Dockerfile, checked statically: no Docker engine here) and the chart's use
of it: the default image can run raykv, and the stock Ray image works only with image.pipInstall."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "raykv"
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
STOCK = {"image": {"repository": "rayproject/ray", "tag": f"{ray.__version__}-py311-gpu"}}


# -- a small Dockerfile reader -------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def arg_defaults(args: str) -> dict[str, str]:
    name, _, default = args.partition("=")
    return {name: default.strip('"')} if default else {}


def stages(text: str) -> list[dict]:
    """Per stage: base image (global ARGs substituted), name, its instructions."""
    global_args: dict[str, str] = {}
    found: list[dict] = []
    for word, args in instructions(text):
        if word == "ARG" and not found:
            global_args.update(arg_defaults(args))
        elif word == "FROM":
            base, _, name = args.partition(" AS ")
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], base)
            found.append({"base": base, "name": name.strip().lower(), "steps": []})
        else:
            found[-1]["steps"].append((word, args))
    return found


@pytest.fixture(scope="module")
def dockerfile() -> list[dict]:
    assert DOCKERFILE.is_file(), "no Dockerfile: the chart's default image cannot be built"
    return stages(DOCKERFILE.read_text())


def test_image_is_built_on_the_supported_ray_release(dockerfile):
    final = dockerfile[-1]["base"]
    repository, _, tag = final.partition(":")
    assert repository == "rayproject/ray"
    ray_version, python, *variant = tag.split("-")
    # the Ray raykv is tested with, inside pyproject's range, the chart's rayVersion
    assert ray_version == ray.__version__
    (ray_req,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray[")]
    assert Version(ray_version) in SpecifierSet(ray_req.split("]", 1)[1])
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["rayVersion"] == ray_version
    # a Python raykv supports; GPU variant, since the chart's default workers have GPUs
    major, minor = python.removeprefix("py")[0], python.removeprefix("py")[1:]
    assert Version(f"{major}.{minor}") in SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert variant == ["gpu"] and values["gpuWorkers"]["enabled"]


def test_image_installs_the_wheel_built_from_this_checkout(dockerfile):
    final, builders = dockerfile[-1], dockerfile[:-1]
    wheel_stages = [
        s for s in builders if any("pip wheel" in a for w, a in s["steps"] if w == "RUN")
    ]
    assert wheel_stages, "no stage builds the raykv wheel"
    copied = {
        Path(src).name
        for s in wheel_stages
        for w, a in s["steps"]
        if w == "COPY"
        for src in [t for t in a.split() if not t.startswith("--")][:-1]
    }
    # the wheel's build inputs, the kernel sources included
    assert {"pyproject.toml", "setup.py", "raykv", "kernels"} <= copied, copied
    installs = [a for w, a in final["steps"] if w == "RUN" and "pip install" in a]
    assert installs, "the final stage installs nothing"
    names = {s["name"] for s in wheel_stages}
    assert any(
        ".whl" in a and re.search(r"from=(\S+?)[ ,]", a + " ").group(1) in names for a in installs
    ), installs
    # installing raykv must not move Ray off the image's (the cluster's) version
    assert any("ray[default]==" in a for a in installs), installs


def test_every_file_the_image_copies_is_in_the_build_context(dockerfile):
    ignore = REPO / ".dockerignore"
    patterns = [
        p.strip()
        for p in (ignore.read_text().splitlines() if ignore.exists() else [])
        if p.strip() and not p.startswith("#")
    ]
    for stage in dockerfile:
        for word, args in stage["steps"]:
            if word != "COPY" or "--from=" in args:
                continue
            for src in [t for t in args.split() if not t.startswith("--")][:-1]:
                assert (REPO / src).exists(), f"COPY {src}: not in the repository"
                assert not any(fnmatch.fnmatch(src, p) for p in patterns), f"{src} is ignored"


def test_image_runs_as_the_ray_user(dockerfile):
    users = [a for w, a in dockerfile[-1]["steps"] if w == "USER"]
    assert users in ([], ["ray"], ["1000"]), users  # the chart runs pods as uid 1000


# -- the chart and the image -------------------------------------------------------------------


def containers(objects: list[dict]) -> list[dict]:
    found = []
    for obj in objects:
        if obj["kind"] == "Pod":
            found += obj["spec"]["containers"]
        elif obj["kind"] == "RayCluster":
            groups = [obj["spec"]["headGroupSpec"], *obj["spec"].get("workerGroupSpecs", [])]
            found += [c for g in groups for c in g["template"]["spec"]["containers"]]
        elif obj["kind"] == "RayJob":
            found += obj["spec"]["submitterPodTemplate"]["spec"]["containers"]
    return found


def ray_containers(objects: list[dict]) -> list[dict]:
    (cluster,) = [o for o in objects if o["kind"] == "RayCluster"]
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    return [g["template"]["spec"]["containers"][0] for g in groups]


def test_default_release_runs_the_raykv_image_of_this_version(render):
    objects = render()
    images = {c["image"] for c in containers(objects)}
    assert len(images) == 1, images
    repository, _, tag = images.pop().rpartition(":")
    assert repository.rsplit("/", 1)[-1] == "raykv"  # not the stock rayproject/ray
    assert tag.startswith(f"{VERSION}-")
    assert tag.endswith("-gpu")  # default workers have GPUs: the image built on Ray's GPU image
    # KubeRay runs its own `ray start` on the raykv image: no command, no override annotation
    for container in ray_containers(objects):
        assert "command" not in container and "args" not in container
    (cluster,) = [o for o in objects if o["kind"] == "RayCluster"]
    assert "ray.io/overwrite-container-cmd" not in cluster["metadata"].get("annotations", {})


@pytest.mark.parametrize("name", ["cpu-only", "default", "production"])
def test_ci_shapes_never_run_the_stock_image_without_installing_raykv(render, name):
    values_file = CHART / "ci" / f"{name}-values.yaml"
    values = yaml.safe_load(values_file.read_text()) or {}
    objects = render(files=[values_file])
    images = {c["image"] for c in containers(objects)}
    for image in images:
        repository = image.rpartition(":")[0]
        assert repository != "rayproject/ray" or values.get("image", {}).get("pipInstall")
    # a GPU worker group needs the image built on Ray's GPU image; a CPU-only one does not
    gpu = any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in ray_containers(objects))
    assert {image.endswith("-gpu") for image in images} == {gpu}, images


PIP = ["raykv @ https://files.example.com/raykv-0.1.0-py3-none-any.whl", "torch==2.13.0"]


def test_stock_image_with_pip_install_installs_raykv_before_ray_starts(render):
    objects = render(values={"image": {**STOCK["image"], "pipInstall": PIP}})
    (cluster,) = [o for o in objects if o["kind"] == "RayCluster"]
    # KubeRay then hands its `ray start` to the container's own command
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for container in ray_containers(objects):
        assert container["image"] == f"rayproject/ray:{STOCK['image']['tag']}"
        assert container["command"][0] == "/bin/bash"
        (script,) = container["args"]
        install, _, start = script.partition(" && ")
        argv = shlex.split(install.split(";")[-1])
        assert argv[argv.index("install") - 1] == "pip" and argv[-len(PIP) :] == PIP
        assert start.strip() == "$KUBERAY_GEN_RAY_START_CMD"
        assert "ulimit -n 65536" in script.split("&&")[0]  # what KubeRay would have run
    (test_pod,) = [o for o in objects if o["kind"] == "Pod"]
    (script,) = test_pod["spec"]["containers"][0]["command"][2:]
    install, _, status = script.partition(" && ")
    assert shlex.split(install)[-len(PIP) :] == PIP
    assert shlex.split(status)[-4:-2] == ["raykv", "status"]


def test_values_schema_accepts_the_defaults_and_checks_pip_install():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    assert [e.message for e in validator.iter_errors(values)] == []
    ok = {**values, "image": {**values["image"], **STOCK["image"], "pipInstall": PIP}}
    assert [e.message for e in validator.iter_errors(ok)] == []
    for bad in ("raykv", [3], [""]):
        wrong = {**values, "image": {**values["image"], "pipInstall": bad}}
        assert list(validator.iter_errors(wrong)), bad
