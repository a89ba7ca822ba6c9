"""Issue 44, item 1 (the plan part): every size and count ``plan()`` and ``ServedModel`` take
is a whole number. nan, inf, floats (2.5 and 2.0 alike), bools, strings and None are
refused with a ConfigError naming the setting, the value and the fix; nothing is rounded.
Numpy integers are taken, as Python ints."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raykv.errors import ConfigError
from raykv.layout import FullAttention, plan
from raykv.service.served import ServedModel, served_model

LAYERS = {"l0": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16)}
ROW = 2 * 16 * 16 * 4  # K,V x 16 tokens x 16 x float32
GOOD = dict(gpu_bytes=24 * ROW, max_model_len=64, max_num_batched_tokens=64, cpu_bytes=8 * ROW)
NOT_WHOLE = {  # value: how the error shows it
    "nan": (math.nan, "got nan (float)"),
    "inf": (math.inf, "got inf (float)"),
    "-inf": (-math.inf, "got -inf (float)"),
    "half": (24 * ROW + 0.5, f"got {24 * ROW + 0.5} (float)"),
    "whole float": (float(24 * ROW), f"got {float(24 * ROW)} (float)"),
    "True": (True, "got True (bool)"),
    "np.bool_": (np.bool_(True), "got np.True_ (bool)"),
    "np.float64": (np.float64(24 * ROW), "(float64)"),
    "str": ("4096", "got '4096' (str)"),
    "None": (None, "got None (NoneType)"),
}


@pytest.mark.parametrize("case", list(NOT_WHOLE))
@pytest.mark.parametrize(
    "setting",
    ["gpu_bytes", "cpu_bytes", "num_gpu_blocks", "max_model_len", "block_size", "tp_size",
     "max_num_batched_tokens", "offload_block_size", "hash_block_size"],
)  # fmt: skip
def test_plan_refuses_sizes_that_are_not_whole_numbers(setting, case) -> None:
    value, shown = NOT_WHOLE[case]
    if value is None and setting in ("gpu_bytes", "num_gpu_blocks", "offload_block_size",
                                     "hash_block_size"):  # fmt: skip
        pytest.skip(f"{setting}=None means its default")
    kwargs = dict(GOOD)
    if setting == "num_gpu_blocks":
        del kwargs["gpu_bytes"]
    kwargs[setting] = value
    with pytest.raises(ConfigError) as e:
        plan(LAYERS, **kwargs)
    msg = str(e.value)
    assert msg.startswith(f"{setting} must be "), msg
    assert shown in msg and "pass an int, e.g." in msg, msg


@pytest.mark.parametrize("setting", ["gpu_bytes", "cpu_bytes", "num_gpu_blocks"])
def test_plan_refuses_negative_sizes_and_names_the_number(setting) -> None:
    kwargs = dict(GOOD)
    if setting == "num_gpu_blocks":
        del kwargs["gpu_bytes"]
    kwargs[setting] = -1
    with pytest.raises(ConfigError, match=rf"^{setting} must be an integer >= 0, got -1 \(int\)"):
        plan(LAYERS, **kwargs)


def test_plan_takes_numpy_integers_as_ints() -> None:
    p = plan(LAYERS, **{k: np.int64(v) for k, v in GOOD.items()})
    want = plan(LAYERS, **GOOD)
    assert p == want and type(p.num_gpu_blocks) is int and type(p.cpu_num_blocks) is int
    assert type(p.max_model_len) is int and p.num_gpu_blocks == 24


MODEL_SETTINGS = {  # setting: (a bad value, the text the error shows)
    "pool_bytes": "pool_bytes must be an integer >= 0",
    "cpu_bytes": "cpu_bytes must be an integer >= 0",
    "max_model_len": "max_model_len must be a positive integer",
    "max_num_batched_tokens": "max_num_batched_tokens must be a positive integer",
    "block_size": "block_size must be a positive integer",
    "tp_size": "tp_size must be a positive integer",
    "offload_block_size": "offload_block_size must be a positive integer",
}


@pytest.mark.parametrize("case", [c for c in NOT_WHOLE if c != "None"])
@pytest.mark.parametrize("setting", list(MODEL_SETTINGS))
def test_served_model_refuses_sizes_that_are_not_whole_numbers(setting, case) -> None:
    """The client builds the ServedModel before any actor call: a refused size raises here,
    so nothing reaches the coordinator (issue 44: pool_bytes nan, inf, 24*4096 + 0.5 and
    True used to kill the pool actor, or be taken as 1 byte)."""
    value, shown = NOT_WHOLE[case]
    settings = {"pool_bytes": 24 * ROW, setting: value}
    max_len = settings.pop("max_model_len", 64)
    with pytest.raises(ConfigError) as e:
        served_model("m", LAYERS, max_len, settings)
    msg = str(e.value)
    assert msg.startswith(MODEL_SETTINGS[setting]) and shown in msg, msg
    assert "pass " in msg and "as an int" in msg, msg


def test_served_model_examples_from_the_issue() -> None:
    for value, shown in [(math.nan, "nan"), (math.inf, "inf"), (24 * 4096 + 0.5, "98304.5")]:
        with pytest.raises(ConfigError, match=rf"pool_bytes must be an integer >= 0, got {shown}"):
            ServedModel("m", LAYERS, 64, pool_bytes=value)
    with pytest.raises(ConfigError, match=r"cpu_bytes must be an integer >= 0, got inf \(float"):
        ServedModel("m", LAYERS, 64, cpu_bytes=math.inf)
    with pytest.raises(ConfigError, match=r"got True \(bool\); pass the KV bytes per pool"):
        ServedModel("m", LAYERS, 64, pool_bytes=True)
    # the defaults and plain ints pass; numpy integers become ints
    m = ServedModel("m", LAYERS, np.int64(64), pool_bytes=np.int64(24 * ROW), cpu_bytes=0)
    assert type(m.max_model_len) is int and type(m.pool_bytes) is int and m.cpu_bytes == 0
    assert m == ServedModel("m", LAYERS, 64, pool_bytes=24 * ROW, cpu_bytes=0)
    assert ServedModel("m", LAYERS, 64).offload_block_size is None


@pytest.mark.parametrize("value", [True, math.nan, math.inf, 0, 1.5, -0.1, "0.9", None])
def test_served_model_refuses_a_gpu_mem_fraction_outside_0_1(value) -> None:
    with pytest.raises(ConfigError, match=r"gpu_mem_fraction must be a number in \(0, 1\], got "):
        ServedModel("m", LAYERS, 64, gpu_mem_fraction=value)


def test_add_model_arguments_that_are_no_setting_or_no_layers_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"add_model has no setting 'pool_byte'; pass only"):
        served_model("m", LAYERS, 64, {"pool_byte": 1 << 20})
    for layers in (None, [("l0", LAYERS["l0"])], "l0"):
        with pytest.raises(ConfigError, match=r"layers must be a dict of layer name -> KV spec"):
            served_model("m", layers, 64, {})
    with pytest.raises(ConfigError, match=r"model name 3 must be letters"):
        served_model(3, LAYERS, 64, {})
