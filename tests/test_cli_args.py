"""``raykv up`` hands its options to the launcher as given (no cluster: the launcher is
replaced); the end-to-end CLI runs live in tests/service/test_cli.py."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from raykv import cli


@pytest.fixture
def launched(monkeypatch) -> dict:
    """``raykv up`` with its launcher replaced: the options the launcher was handed."""
    from raykv.service.control import launcher, ray_join

    seen: dict = {}

    def fake_up(address, **kw):
        seen.update(kw, address=address)
        out = {"address": "127.0.0.1:1", "started_head": True, "token": None}
        if kw["preset"]:  # a model served: what the launcher reports of it
            out |= {"started_head": False, "model": kw["preset"], "num_gpu_blocks": 8,
                    "cpu_num_blocks": 4, "nodes": 1, "members": 3}  # fmt: skip
        return out

    monkeypatch.setattr(launcher, "up", fake_up)
    monkeypatch.setattr(ray_join, "prepare_auth", lambda **_: None)
    monkeypatch.setattr(cli, "_bounded", lambda *a: None, raising=False)
    return seen


def _head_env(monkeypatch, **settings) -> dict[str, str]:
    """The environment ``launcher.up`` (no address, no preset, ``settings``) gives the Ray
    head it starts, which is replaced by a stop right there."""
    from raykv.errors import ServiceError
    from raykv.service.control import launcher

    head_env: dict[str, str] = {}

    def start_head(num_cpus, env=None):
        head_env.update(env or {})
        raise ServiceError("stop here: the head's environment is all this test needs")

    monkeypatch.setattr(launcher, "local_address", lambda: None)
    monkeypatch.setattr(launcher, "_stop_stale_head", lambda: None)
    monkeypatch.setattr(launcher, "start_head", start_head)
    with pytest.raises(ServiceError, match="stop here"):
        launcher.up(None, preset=None, cpu_bytes=1, gpu_mem_fraction=0.9, block_size=16,
                    max_model_len=None, pool_bytes=0, **settings)  # fmt: skip
    return head_env


def test_up_passes_tp_and_sizes_to_the_launcher(launched) -> None:
    seen = launched
    res = CliRunner().invoke(
        cli.main,
        ["up", "--address", "127.0.0.1:1", "--preset", "llama-3-8b", "--tp", "2",
         "--block-size", "32"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert seen["tp_size"] == 2 and seen["block_size"] == 32 and seen["address"] == "127.0.0.1:1"
    assert seen["cpu_bytes"] == 1 << 30 and seen["gpu_mem_fraction"] == 0.9  # preset defaults
    bad = CliRunner().invoke(cli.main, ["up", "--preset", "llama-3-8b", "--tp", "0"])
    assert bad.exit_code != 0 and "--tp" in bad.output


def test_up_serves_no_model_unless_a_preset_is_named(launched) -> None:
    """A bare ``raykv up`` takes no GPU (engines add their models); sizes without a preset
    are a usage error naming them, not silently ignored."""
    seen = launched
    res = CliRunner().invoke(cli.main, ["up"])
    assert res.exit_code == 0, res.output
    assert seen["preset"] is None and "no model served yet" in res.output
    bad = CliRunner().invoke(cli.main, ["up", "--cpu-mem", "4GiB", "--tp", "2"])
    assert bad.exit_code == 2 and seen.get("cpu_bytes") != 4 << 30
    assert "--cpu-mem, --tp" in bad.output and "--preset NAME" in bad.output


def test_up_passes_the_disk_tier_with_or_without_a_preset(launched, tmp_path) -> None:
    """--disk-path and --disk-bytes go together and reach the launcher as (folder, bytes)."""
    seen = launched
    where = tmp_path / "slabs"
    res = CliRunner().invoke(cli.main, ["up", "--disk-path", str(where), "--disk-bytes", "2GiB"])
    assert res.exit_code == 0, res.output
    assert seen["disk"] == (str(where), 2 << 30) and where.is_dir()
    assert "disk tier in" in res.output
    bad = CliRunner().invoke(cli.main, ["up", "--disk-path", str(where)])
    assert bad.exit_code == 2 and "go together" in bad.output
    bad = CliRunner().invoke(cli.main, ["up", "--disk-path", str(where), "--disk-bytes", "lots"])
    assert bad.exit_code == 1 and "cannot read size" in bad.output


def test_up_passes_tenant_quotas_by_label_and_refuses_bad_ones(launched, monkeypatch) -> None:
    """--tenant-quota NAME=SIZE (repeatable) reaches the launcher as ``TenantQuotas``, a salt
    as its label (never the salt itself); a bad one is a usage error naming the fix; quotas
    for a cluster that runs already are refused (they configure the head raykv up starts)."""
    from raykv.blocks.hashing import tenant_key, tenant_label
    from raykv.errors import ConfigError
    from raykv.service.control import launcher
    from raykv.tiers.quotas import TenantQuotas

    seen = launched
    args = ["up", "--tenant-quota", "default=8GiB", "--tenant-quota", "acme=1GiB"]
    res = CliRunner().invoke(cli.main, args)
    assert res.exit_code == 0, res.output
    label = tenant_label(tenant_key("acme"))
    assert seen["tenant_quotas"] == TenantQuotas({label: 1 << 30}, 8 << 30)
    assert "acme" not in seen["tenant_quotas"].to_env() and "acme" not in res.output
    assert f"default 8.00 GiB, {label} 1.00 GiB" in res.output
    bad = CliRunner().invoke(cli.main, ["up", "--tenant-quota", "acme:1GiB"])
    assert bad.exit_code == 2 and "NAME=SIZE" in bad.output
    monkeypatch.undo()  # the launcher itself
    with pytest.raises(ConfigError, match="RAYKV_TENANT_QUOTAS=default=1024"):
        launcher.up("127.0.0.1:1", preset=None, cpu_bytes=1, gpu_mem_fraction=0.9,
                    block_size=16, max_model_len=None, pool_bytes=0,
                    tenant_quotas=TenantQuotas({}, 1024))  # fmt: skip


def test_up_passes_disk_tenant_quotas_into_the_heads_environment(
    launched, monkeypatch, tmp_path
) -> None:
    """--disk-tenant-quota NAME=SIZE (repeatable, with --disk-path) reaches the launcher as
    the disk tier's own ``TenantQuotas`` (the CPU tier's stay apart), and the head raykv up
    starts gets it as ``RAYKV_DISK_TENANT_QUOTAS`` (labels only), beside the disk settings;
    without a disk tier, or for a cluster that runs already, it is refused."""
    from raykv.blocks.hashing import tenant_key, tenant_label
    from raykv.errors import ConfigError
    from raykv.service.control import launcher
    from raykv.tiers.quotas import TenantQuotas

    seen = launched
    where = str(tmp_path / "slabs")
    disk = ["--disk-path", where, "--disk-bytes", "100GiB"]
    args = ["up", *disk, "--disk-tenant-quota", "default=50GiB", "--disk-tenant-quota",
            "acme=10GiB", "--tenant-quota", "acme=1GiB"]  # fmt: skip
    res = CliRunner().invoke(cli.main, args)
    assert res.exit_code == 0, res.output
    label = tenant_label(tenant_key("acme"))
    quotas = TenantQuotas({label: 10 << 30}, 50 << 30)
    assert seen["disk_tenant_quotas"] == quotas
    assert seen["tenant_quotas"] == TenantQuotas({label: 1 << 30})
    assert f"disk-tier tenant quotas per node and model (by label): default 50.00 GiB, {label} " \
        "10.00 GiB" in res.output  # fmt: skip
    bad = CliRunner().invoke(cli.main, ["up", "--disk-tenant-quota", "default=1GiB"])
    assert bad.exit_code == 2 and "--disk-path FOLDER --disk-bytes SIZE" in bad.output
    bad = CliRunner().invoke(cli.main, ["up", *disk, "--disk-tenant-quota", "acme:1GiB"])
    assert bad.exit_code == 2 and "--disk-tenant-quota 'acme:1GiB'" in bad.output
    monkeypatch.undo()  # the launcher itself: the head's environment
    head_env = _head_env(monkeypatch, disk=(where, 100 << 30), disk_tenant_quotas=quotas)
    assert head_env == {
        "RAYKV_DISK_PATH": where,
        "RAYKV_DISK_BYTES": str(100 << 30),
        "RAYKV_DISK_TENANT_QUOTAS": f"default={50 << 30},{label}={10 << 30}",
    }
    with pytest.raises(ConfigError, match=f"RAYKV_DISK_TENANT_QUOTAS=default={50 << 30}"):
        launcher.up("127.0.0.1:1", preset=None, cpu_bytes=1, gpu_mem_fraction=0.9,
                    block_size=16, max_model_len=None, pool_bytes=0,
                    disk_tenant_quotas=quotas)  # fmt: skip


def test_up_passes_object_tenant_quotas_into_the_heads_environment(launched, monkeypatch) -> None:
    """--object-tenant-quota NAME=SIZE (repeatable, with --object-url) reaches the launcher
    as the object tier's own ``TenantQuotas``, and the head raykv up starts gets it as
    ``RAYKV_OBJECT_TENANT_QUOTAS`` (labels only), beside the object settings; without an
    object tier, or for a cluster that runs already, it is refused."""
    from raykv.blocks.hashing import tenant_key, tenant_label
    from raykv.errors import ConfigError
    from raykv.service.control import launcher
    from raykv.tiers.quotas import TenantQuotas

    seen = launched
    url = ["--object-url", "s3://kv/p"]
    args = ["up", *url, "--object-tenant-quota", "default=1TiB", "--object-tenant-quota",
            "acme=10GiB"]  # fmt: skip
    res = CliRunner().invoke(cli.main, args)
    assert res.exit_code == 0, res.output
    label = tenant_label(tenant_key("acme"))
    quotas = TenantQuotas({label: 10 << 30}, 1 << 40)
    assert seen["object_tenant_quotas"] == quotas and seen["disk_tenant_quotas"] is None
    assert seen["objects"] == ("s3://kv/p", None) and seen["tenant_quotas"] is None
    assert f"object-tier tenant quotas per model, in the bucket (by label): default 1.00 TiB, " \
        f"{label} 10.00 GiB" in res.output  # fmt: skip
    bad = CliRunner().invoke(cli.main, ["up", "--object-tenant-quota", "default=1GiB"])
    assert bad.exit_code == 2 and "--object-url s3://BUCKET/PREFIX" in bad.output
    bad = CliRunner().invoke(cli.main, ["up", *url, "--object-tenant-quota", "acme:1GiB"])
    assert bad.exit_code == 2 and "--object-tenant-quota 'acme:1GiB'" in bad.output
    monkeypatch.undo()  # the launcher itself: the head's environment
    head_env = _head_env(monkeypatch, objects=("s3://kv/p", None), object_tenant_quotas=quotas)
    assert head_env == {
        "RAYKV_OBJECT_URL": "s3://kv/p",
        "RAYKV_OBJECT_TENANT_QUOTAS": f"default={1 << 40},{label}={10 << 30}",
    }
    with pytest.raises(ConfigError, match=f"RAYKV_OBJECT_TENANT_QUOTAS=default={1 << 40}"):
        launcher.up("127.0.0.1:1", preset=None, cpu_bytes=1, gpu_mem_fraction=0.9,
                    block_size=16, max_model_len=None, pool_bytes=0,
                    object_tenant_quotas=quotas)  # fmt: skip


def test_up_passes_the_object_tier(launched) -> None:
    """--object-url (with --object-endpoint or not) reaches the launcher as (url, endpoint);
    an endpoint alone or a URL that is not s3:// is a usage error naming the fix."""
    seen = launched
    args = ["up", "--object-url", "s3://kv/p", "--object-endpoint", "http://127.0.0.1:9000"]
    res = CliRunner().invoke(cli.main, args)
    assert res.exit_code == 0, res.output
    assert seen["objects"] == ("s3://kv/p", "http://127.0.0.1:9000")
    assert "object tier in s3://kv/p at http://127.0.0.1:9000" in res.output
    bad = CliRunner().invoke(cli.main, ["up", "--object-endpoint", "http://127.0.0.1:9000"])
    assert bad.exit_code == 2 and "--object-url s3://BUCKET/PREFIX" in bad.output
    bad = CliRunner().invoke(cli.main, ["up", "--object-url", "kv/p"])
    assert bad.exit_code == 2 and "s3://BUCKET" in bad.output


def _stats(lookups: int) -> dict:
    """What the coordinator's ``stats`` answers, for a service of one node and no members."""
    return {"address": "127.0.0.1:1", "uptime_s": 1.0, "models": {}, "members": [],
            "nodes": [{"node_id": "n" * 12, "address": "127.0.0.1", "alive": True, "gpus": 0}],
            "lookups": lookups, "hit_rate": 0.5, "hits": {"local_gpu": 1}, "misses": 1,
            "indexed_blocks": 2}  # fmt: skip


def _watching(monkeypatch, frames: list) -> tuple[list[float], list[str]]:
    """``raykv status --watch`` with ``launcher.status`` answering the first frame and
    ``read_status`` the rest, in turn (an exception is raised); no Ray, no Serve, no sleep.
    Returns the sleeps and the screen clears, as they happen."""
    import sys
    import threading
    import time

    import click

    from raykv.service.control import launcher, ray_join

    slept, cleared = [], []
    frames = iter(frames)

    def next_frame(*_):
        frame = next(frames)
        if isinstance(frame, BaseException):
            raise frame
        return frame

    monkeypatch.setattr(launcher, "status", next_frame)
    monkeypatch.setattr(launcher, "read_status", next_frame)
    monkeypatch.setattr(ray_join, "prepare_auth", lambda **_: None)
    monkeypatch.setattr(cli, "_bounded", lambda *a: threading.Timer(1, lambda: None))
    monkeypatch.setitem(sys.modules, "raykv.integrations.serve.app", None)  # without Serve
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(click, "clear", lambda: cleared.append("clear"))
    return slept, cleared


def test_status_watch_redraws_until_ctrl_c_then_exits_0(monkeypatch) -> None:
    slept, cleared = _watching(monkeypatch, [_stats(7), _stats(9), KeyboardInterrupt()])
    res = CliRunner().invoke(cli.main, ["status", "--watch"])
    assert res.exit_code == 0, res.output
    assert res.output.count("raykv status every 2s") == 2 and cleared == ["clear"] * 2
    assert res.output.index("lookups 7 ") < res.output.index("lookups 9 ")
    assert slept == [2.0, 2.0]


def test_status_watch_draws_a_silent_service_and_stops_at_a_gone_one(monkeypatch) -> None:
    """A frame the coordinator does not answer says so and the watch goes on; a service
    that no longer runs ends it with that error (exit 1)."""
    from raykv.errors import ServiceError, ServiceGone

    silent = ServiceError("the raykv coordinator did not answer 'stats' within 10s")
    gone = ServiceGone("Ray runs at 127.0.0.1:1 but the raykv service does not (raykv up)")
    slept, _ = _watching(monkeypatch, [_stats(1), silent, _stats(2), gone])
    res = CliRunner().invoke(cli.main, ["status", "--watch", "0.5"])
    assert res.exit_code == 1, res.output
    assert f"service not answering ({silent})" in res.output
    assert "lookups 2 " in res.output and res.output.rstrip().endswith(f"Error: {gone}")
    assert slept == [0.5] * 3


def test_status_watch_takes_no_json_and_no_tiny_period() -> None:
    res = CliRunner().invoke(cli.main, ["status", "--watch", "--json"])
    assert res.exit_code == 2 and "--json prints the stats once" in res.output
    res = CliRunner().invoke(cli.main, ["status", "--watch", "0.1"])
    assert res.exit_code == 2 and "--watch" in res.output


def test_demo_reports_a_ray_cluster_that_does_not_start_as_a_clear_error(monkeypatch) -> None:
    """Ray's own startup errors (a busy host's raylet registering too late) reach the user
    as one line naming the fix, never a traceback."""
    import ray.cluster_utils

    from raykv import demo

    def no_cluster(*args, **kwargs):
        raise Exception("The current node timed out during startup.")

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(demo, "_ucx_env", lambda: False)
    monkeypatch.setattr(ray.cluster_utils, "Cluster", no_cluster)
    res = CliRunner().invoke(cli.main, ["demo"])
    assert res.exit_code == 1, res.output
    assert "did not start (Exception: The current node timed out" in res.output
    assert "RAY_raylet_start_wait_time_s=120" in res.output
    assert "Traceback" not in res.output and res.exception is not None
