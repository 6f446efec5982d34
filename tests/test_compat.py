"""The torch releases of the supported range (disttrain.torchcompat): a feature of a newer torch is
dropped where unused and refused in one line where asked for, on whatever torch is installed.

``make compat`` (bench/compat.py) runs this module in every venv of the matrix, beside the smoke
set; here, in the suite, it runs on the pinned torch.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, cli_env
from disttrain import torchcompat
from disttrain.config import torchrun
from disttrain.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class OldLaunchConfig:
    """A LaunchConfig as torch 2.6 has it: none of the fields of 2.8 and later."""

    min_nodes: int
    max_nodes: int
    log_line_prefix_template: str | None = None


def test_a_field_this_torch_lacks_is_dropped_when_unused_and_refused_in_one_line_when_asked(monkeypatch):
    from torch.distributed.launcher import api

    monkeypatch.setattr(api, "LaunchConfig", OldLaunchConfig)
    unused = {"event_log_handler": "null", "numa_options": None, "signals_to_handle": torchrun.DEFAULT_SIGNALS,
              "duplicate_stdout_filters": None, "duplicate_stderr_filters": None, "virtual_local_rank": False,
              "shutdown_timeout": 15}
    config = torchcompat.launch_config(min_nodes=1, max_nodes=2, log_line_prefix_template="[x] ", **unused)
    assert config == OldLaunchConfig(min_nodes=1, max_nodes=2, log_line_prefix_template="[x] ")
    for field, value, option, since in (("numa_options", object(), "--numa-binding", "2.9"),
                                        ("virtual_local_rank", True, "--virtual-local-rank", "2.10"),
                                        ("event_log_handler", "console", "--event-log-handler", "2.8")):
        with pytest.raises(UsageError) as err:
            torchcompat.launch_config(min_nodes=1, max_nodes=1, **{field: value})
        assert f"{option} needs torch {since} or newer" in str(err.value)
        assert "\n" not in str(err.value)


def test_every_field_disttrain_may_set_is_this_torchs_or_has_its_release_named():
    from torch.distributed.launcher.api import LaunchConfig

    have = {f.name for f in dataclasses.fields(LaunchConfig)}
    source = (ROOT / "src" / "disttrain" / "agent" / "elastic_config.py").read_text()
    call = source[source.index("torchcompat.launch_config("):]
    set_here = {line.split("=")[0].strip() for line in call.splitlines()[1:] if "=" in line and line.startswith(" " * 8)}
    assert set_here - have <= set(torchcompat._FIELD_SINCE), sorted(set_here - have)


def test_the_options_of_a_newer_torch_are_refused_in_one_line_before_anything_starts(tmp_path):
    missing = sorted(set(torchcompat.OPTION_SINCE) - torchcompat.torchrun_dests())
    if not missing:
        pytest.skip(f"torch {torchcompat.torch_version()} has every torchrun option disttrain knows")
    values = {"print_completion": "bash", "log_line_prefix_template": "${rank}: ", "numa_binding": "node",
              "event_log_handler": "console", "signals_to_handle": "SIGTERM", "shutdown_timeout": "5"}
    for dest in missing:
        flag = f"--{dest.replace('_', '-')}"
        argv = [flag] if torchrun.BY_DEST[dest].flag else [flag, values.get(dest, "x")]
        r = subprocess.run([sys.executable, "-m", "disttrain", "run", *argv, "-n", "1", str(SCRIPTS / "sleeper.py")],
                           capture_output=True, text=True, timeout=120, env=cli_env(), cwd=tmp_path)
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.strip() == (f"disttrain: error: {flag} needs torch {torchcompat.OPTION_SINCE[dest]} or newer; "
                                    f"this machine has torch {torchcompat.torch_version()} (upgrade torch, or drop "
                                    f"{flag})"), r.stderr
        assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_print_completion_completes_disttrain_where_this_torch_has_it(tmp_path):
    if "print_completion" not in torchcompat.torchrun_dests():
        pytest.skip("this torch has no --print-completion (torch 2.14)")
    r = subprocess.run([sys.executable, "-m", "disttrain", "run", "--print-completion", "bash"],
                       capture_output=True, text=True, timeout=120, env=cli_env(), cwd=tmp_path)
    try:
        import shtab  # noqa: F401
    except ImportError:
        assert r.returncode == 2 and r.stderr.strip().endswith("needs the shtab package: pip install shtab"), r.stderr
    else:
        assert r.returncode == 0 and "disttrain" in r.stdout and "--nproc-per-node" in r.stdout, r.stderr


def test_fsdp_where_cpu_streams_cannot_record_events_is_one_line():
    import torch

    if hasattr(torch.cpu.Stream, "record_event"):
        pytest.skip(f"torch {torchcompat.torch_version()} runs FSDP2 on the CPU (tests/test_sharded.py)")
    r = subprocess.run([sys.executable, "-m", "disttrain", "run", "-n", "2", str(SCRIPTS / "sharded_train.py"),
                        "/dev/null", "--strategy", "fsdp"], capture_output=True, text=True, timeout=180, env=cli_env())
    assert r.returncode != 0
    assert 'strategy="fsdp" on cpu needs torch 2.7 or newer' in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_a_hang_watch_without_the_recorder_of_gloo_says_what_it_sees(tmp_path):
    from disttrain.agent import flight

    if flight.CPU_FR_HANDLER in torchcompat.worker_handlers():
        pytest.skip(f"torch {torchcompat.torch_version()} serves gloo's recorder (tests/test_hangs.py)")
    r = subprocess.run([sys.executable, "-m", "disttrain", "run", "-n", "2", "--hang-timeout", "30",
                        str(SCRIPTS / "ranks_report.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=180, env=cli_env())
    assert r.returncode == 0, r.stderr
    assert (f"does not serve a record of gloo's collectives (torch {flight.FR_SINCE} does): --hang-timeout sees the "
            "progress of a script on disttrain's runtime") in r.stderr
