"""The settings module: every RPP_* variable typed in one place, ``configure`` over the environment."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import roundpipe
from roundpipe import settings
from roundpipe.devices import allocator, device

ROOT = Path(__file__).resolve().parents[1]


REGENERATE = "regenerate with settings.markdown_table() / settings.markdown_table(internal=True)"


@pytest.mark.parametrize("marker, internal", [("settings table", False), ("internal settings table", True)])
def test_user_guide_tables_are_the_registry(marker: str, internal: bool) -> None:
    """The user table and the internal one are what the registry renders, so neither drifts from the code."""
    text = (ROOT / "docs" / "user-guide.md").read_text()
    table = text.split(f"<!-- {marker}: begin -->\n", 1)[1].split(f"\n<!-- {marker}: end -->", 1)[0]
    assert table == settings.markdown_table(internal=internal), REGENERATE


def test_internal_settings_are_the_debug_namespace() -> None:
    internal = [s.name for s in settings.REGISTRY.values() if s.internal]
    assert internal and all(n.startswith("RPP_DEBUG_") for n in internal)
    assert "RPP_DEBUG_GRAPHS" in internal and "RPP_DEVICES" not in internal
    user_table = settings.markdown_table()
    assert "RPP_DEBUG_" not in user_table and "`RPP_DEVICES`" in user_table
    assert all(f"`{n}`" in settings.markdown_table(internal=True) for n in internal)


def test_a_user_can_hold_the_user_settings_in_their_head() -> None:
    """At most 15 settings are for users; everything else is an internal ``RPP_DEBUG_*`` aid."""
    user = [s.name for s in settings.REGISTRY.values() if not s.internal]
    assert len(user) <= 15, user


def test_retired_names_are_no_settings_and_name_their_replacement() -> None:
    from roundpipe.settings import retired as retired_settings

    assert not set(retired_settings.RETIRED) & set(settings.REGISTRY)
    for old, what in retired_settings.RETIRED.items():
        new = what.split()[1] if what.startswith("renamed ") else None
        assert new is None or new in settings.REGISTRY, (old, what)
    env = {"RPP_VERBOSE_TIMER": "1", "RPP_GRAD_STREAM": "0", "RPP_DEVCES": "cpu:2", "RPP_DEVICES": "cpu:1", "X": "1"}
    assert retired_settings.unknown_variables(env, settings.REGISTRY) == [
        "RPP_DEVCES: not a roundpipe setting (see roundpipe.settings.REGISTRY)",
        "RPP_GRAD_STREAM: removed: parameter gradients always download on a stream of their own",
        "RPP_VERBOSE_TIMER: renamed RPP_DEBUG_TIMER",
    ]


def test_import_warns_once_about_an_old_name_in_the_environment() -> None:
    """A renamed setting still exported by a user's shell is not ignored in silence: one warning at import names
    its replacement; a known setting draws none."""
    import subprocess
    import sys

    code = "import warnings; warnings.simplefilter('always'); import roundpipe"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RPP_")}
    old = subprocess.run([sys.executable, "-c", code], env={**base, "RPP_GRAPHS": "0"}, capture_output=True, text=True)
    assert old.returncode == 0, old.stderr
    assert old.stderr.count("roundpipe ignores these environment variables") == 1, old.stderr
    assert "RPP_GRAPHS: renamed RPP_DEBUG_GRAPHS" in old.stderr, old.stderr
    new = subprocess.run(
        [sys.executable, "-c", code], env={**base, "RPP_DEBUG_GRAPHS": "0"}, capture_output=True, text=True
    )
    assert new.returncode == 0 and "ignores" not in new.stderr, new.stderr


def test_no_module_reads_rpp_variables_from_the_environment() -> None:
    """Only ``roundpipe/settings/`` turns RPP_* text into values (the rest asks it)."""
    offenders = []
    for path in (ROOT / "roundpipe").rglob("*.py"):
        if ROOT / "roundpipe" / "settings" in path.parents:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"environ(\.get)?[\[(]\s*[\"']RPP_", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert not offenders


@pytest.mark.parametrize(
    "setting, good, value, bad",
    [
        (settings.STEP_MODE, "streamed", "streamed", "stream"),
        (settings.DEBUG_FUSED_STAGING, "off", "0", "maybe"),
        (settings.DEBUG_DEVICE_SAVED_GB, "1.5", 1.5, "-1"),
        (settings.WATCHDOG_S, "30", 30.0, "soon"),
        (settings.WATCHDOG_S, "AUTO", None, "-1"),
        (settings.PROFILER, " NVTX ", "nvtx", "nsys"),
        (settings.OPTIM_THREADS, "4", 4, "0"),
        (settings.DEBUG_ADAM_IMPL, "CPP", "cpp", "fast"),
        (settings.DEBUG_FUSED_KERNELS, "on", "1", "sometimes"),
        (settings.DIST_TIMEOUT_S, "12.5", 12.5, "0"),
        (settings.DIST_MAIN_TIMEOUT_S, "60", 60.0, "inf"),
    ],
)
def test_values_defaults_and_errors(
    monkeypatch: pytest.MonkeyPatch, setting: settings.Setting, good: str, value: object, bad: str
) -> None:
    monkeypatch.delenv(setting.name, raising=False)
    assert setting.get() == setting.default and not setting.is_set()
    monkeypatch.setenv(setting.name, "  ")
    assert setting.get() == setting.default
    monkeypatch.setenv(setting.name, good)
    assert setting.get() == value and setting.is_set()
    monkeypatch.setenv(setting.name, bad)
    with pytest.raises(ValueError, match=re.escape(f"{setting.name}={bad!r}: expected {setting.accepts}")):
        setting.get()


def test_configure_wins_over_the_environment_and_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPP_STEP_MODE", "staged")
    monkeypatch.delenv("RPP_DISABLE_TORCH_COMPILE", raising=False)
    roundpipe.configure(step_mode="streamed", devices="cpu:2", compile=False)
    assert settings.STEP_MODE.get() == "streamed" and settings.DISABLE_TORCH_COMPILE.get() is True
    assert roundpipe.get_num_devices() == 2
    assert os.environ.get("RPP_DEVICES") != "cpu:2"  # chosen for this process, not written to the environment
    with settings.overridden(step_mode="staged"):
        assert settings.STEP_MODE.get() == "staged"
    assert settings.STEP_MODE.get() == "streamed"
    settings.unconfigure()
    device.reset_devices()
    assert settings.STEP_MODE.get() == "staged" and settings.DISABLE_TORCH_COMPILE.get() is False


def test_configure_takes_internal_settings_by_their_lower_case_name() -> None:
    roundpipe.configure(debug_graphs="0", debug_stress_delay_s=0.5)
    assert settings.DEBUG_GRAPHS.get() == "0" and settings.DEBUG_STRESS_DELAY_S.get() == 0.5
    with pytest.raises(TypeError, match=re.escape("unknown setting 'graphs' (RPP_GRAPHS: renamed RPP_DEBUG_GRAPHS)")):
        roundpipe.configure(graphs="0")  # the old name


def test_configure_rejects_unknown_names_and_bad_values() -> None:
    with pytest.raises(TypeError, match="unknown setting 'step_modes'"):
        roundpipe.configure(step_modes="staged")
    with pytest.raises(ValueError, match="RPP_DEVICES='gpu:1'"):
        roundpipe.configure(devices="gpu:1")
    with pytest.raises(ValueError):
        roundpipe.configure(step_mode="stream")
    assert not settings.snapshot()


def test_default_microbatch_count_is_one_function() -> None:
    from roundpipe.run_config import FullRoundPipeRunConfig, RoundPipeRunConfig

    full = FullRoundPipeRunConfig(RoundPipeRunConfig(), RoundPipeRunConfig())
    assert full.num_microbatch == settings.default_num_microbatch(roundpipe.get_num_devices())


def _alloc_env_after_import(env: dict, preamble: str = "") -> dict:
    import json
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in allocator.ALLOC_CONF_VARS}
    code = preamble + "import os, json, roundpipe; print(json.dumps({k: os.environ.get(k) for k in %r}))" % (
        allocator.ALLOC_CONF_VARS,
    )
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_chooses_expandable_segments_only_when_nobody_chose() -> None:
    """``import roundpipe`` gives the CUDA allocator expandable segments (small cards fail long sequences
    on fragmentation otherwise) unless the user set the allocator's variable, whatever it says; torch
    imported first (CUDA not started) changes nothing."""
    chosen = _alloc_env_after_import({})
    assert "expandable_segments:True" in [v for v in chosen.values() if v], chosen
    assert _alloc_env_after_import({}, preamble="import torch; ") == chosen
    for name in allocator.ALLOC_CONF_VARS:
        mine = _alloc_env_after_import({name: "expandable_segments:False"})
        assert mine[name] == "expandable_segments:False" and all(
            mine[n] is None for n in allocator.ALLOC_CONF_VARS if n != name
        ), mine


def test_import_leaves_expandable_segments_to_pools_of_two_gpus_or_fewer() -> None:
    """Graph captures failed with expandable segments on 4 GPUs, also when they were withdrawn at the first job:
    ``import roundpipe`` does not choose them for a pool of more than two GPUs whose jobs may be graphed."""
    assert not any(_alloc_env_after_import({"RPP_DEVICES": "cuda:0,1,2"}).values())
    assert "expandable_segments:True" in _alloc_env_after_import({"RPP_DEVICES": "cuda:0,1"}).values()
    eager = _alloc_env_after_import({"RPP_DEVICES": "cuda:0,1,2,3", "RPP_DEBUG_GRAPHS": "0"})
    assert "expandable_segments:True" in eager.values()


def test_pool_settles_the_segments_handle_type_before_its_threads_allocate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several GPUs' first expandable segments made at once race on torch's process-wide handle type ("CUDA driver
    error: operation not permitted" on a 2-GPU pool's first job): the pool makes one allocation on the creating
    thread before any controller thread starts, once per process, and only for pools of several GPUs."""
    import torch

    events = []
    monkeypatch.setattr(allocator, "_handle_type_settled", False)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: events.append(("probe", str(k["device"]))))
    monkeypatch.setattr(
        device.backend, "parse_devices", lambda spec: [torch.device("cuda", 0), torch.device("cuda", 1)]
    )
    monkeypatch.setattr(device, "DeviceManager", lambda i, d: events.append(("controller", str(d))) or object())
    monkeypatch.setattr(device, "device_list", [])
    device.get_devices()
    assert events == [("probe", "cuda:0"), ("controller", "cuda:0"), ("controller", "cuda:1")]
    monkeypatch.setattr(device, "device_list", [])
    device.get_devices()  # a re-created pool: the type is chosen already
    assert [e for e in events if e[0] == "probe"] == [("probe", "cuda:0")]
    monkeypatch.setattr(allocator, "_handle_type_settled", False)
    assert not allocator.settle_expandable_handle_type([torch.device("cuda", 0)])  # one GPU races with nobody
    assert not allocator.settle_expandable_handle_type([])  # CPU workers
    assert [e for e in events if e[0] == "probe"] == [("probe", "cuda:0")]


def test_pool_size_before_cuda_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RPP_DEVICES`` names the pool; without it NVML counts the visible GPUs (without torch:
    ``tests/test_gpu_count.py`` compares the count with torch's); unknown when NVML fails."""
    from roundpipe.devices import gpu_count

    monkeypatch.setenv("RPP_DEVICES", "cuda:1,3")
    assert allocator.pool_gpus_from_environment() == 2
    monkeypatch.setenv("RPP_DEVICES", "cpu:4")
    assert allocator.pool_gpus_from_environment() == 0
    monkeypatch.setenv("RPP_DEVICES", "cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpu_count, "physical_gpus", lambda: 4)
    assert allocator.pool_gpus_from_environment() == 4
    monkeypatch.setattr(gpu_count, "physical_gpus", lambda: None)
    assert allocator.pool_gpus_from_environment() is None
