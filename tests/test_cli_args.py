"""``raykv up`` hands its options to the launcher as given (no cluster: the launcher is
replaced); the end-to-end CLI runs live in tests/service/test_cli.py."""

from __future__ import annotations

from click.testing import CliRunner

from raykv import cli


def test_up_passes_tp_and_sizes_to_the_launcher(monkeypatch) -> None:
    from raykv.service.control import launcher, ray_join

    seen: dict = {}

    def fake_up(address, **kw):
        seen.update(kw, address=address)
        return {"address": "127.0.0.1:1", "started_head": False, "token": None,
                "model": kw["preset"], "num_gpu_blocks": 8, "cpu_num_blocks": 4,
                "nodes": 1, "members": 3}  # fmt: skip

    monkeypatch.setattr(launcher, "up", fake_up)
    monkeypatch.setattr(ray_join, "prepare_auth", lambda **_: None)
    monkeypatch.setattr(cli, "_bounded", lambda *a: None, raising=False)
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


def test_up_serves_no_model_unless_a_preset_is_named(monkeypatch) -> None:
    """A bare ``raykv up`` takes no GPU (engines add their models); sizes without a preset
    are a usage error naming them, not silently ignored."""
    from raykv.service.control import launcher, ray_join

    seen: dict = {}

    def fake_up(address, **kw):
        seen.update(kw)
        return {"address": "127.0.0.1:1", "started_head": True, "token": None}

    monkeypatch.setattr(launcher, "up", fake_up)
    monkeypatch.setattr(ray_join, "prepare_auth", lambda **_: None)
    monkeypatch.setattr(cli, "_bounded", lambda *a: None, raising=False)
    res = CliRunner().invoke(cli.main, ["up"])
    assert res.exit_code == 0, res.output
    assert seen["preset"] is None and "no model served yet" in res.output
    bad = CliRunner().invoke(cli.main, ["up", "--cpu-mem", "4GiB", "--tp", "2"])
    assert bad.exit_code == 2 and seen.get("cpu_bytes") != 4 << 30
    assert "--cpu-mem, --tp" in bad.output and "--preset NAME" in bad.output
