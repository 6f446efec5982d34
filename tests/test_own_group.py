"""A script that makes its own process group at a fixed address, rank or world size (PyTorch's AWS
tutorial's ``main.py``) ends at once with one line naming its file:line and what to pass instead,
not with a port collision; a script that takes the launcher's group runs as before."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from conftest import disttrain

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src" / "disttrain" / "_worker_site"))
from _disttrain_group_check import mismatches  # noqa: E402

pytestmark = pytest.mark.timeout(180)

TUTORIAL = """\
    import sys

    import torch.distributed as dist

    world_size = 4
    dist_url = "tcp://127.0.0.1:23456"
    dist.init_process_group(backend="gloo", init_method=dist_url, rank=int(sys.argv[1]), world_size=world_size)
    print("joined", dist.get_rank())
"""
LAUNCHER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("kwargs, found", [
    ({"init_method": "env://"}, []),
    ({}, []),
    ({"init_method": "tcp://127.0.0.1:29500", "rank": 1, "world_size": 2}, []),
    ({"init_method": "tcp://localhost:29500"}, []),  # the same host by another name
    ({"init_method": "tcp://127.0.0.1:23456"}, ["init_method 'tcp://127.0.0.1:23456' is not the launcher's "
                                                "127.0.0.1:29500"]),
    ({"world_size": 4, "rank": 0}, ["world_size=4 where the launcher gave WORLD_SIZE=2",
                                    "rank=0 where the launcher gave RANK=1"]),
    ({"init_method": "tcp://127.0.0.1:23456", "store": object()}, []),  # a store wins over init_method
])
def test_what_disagrees_with_the_launcher(kwargs, found):
    assert mismatches(kwargs, LAUNCHER) == found


def test_the_tutorials_own_group_is_named_at_its_line(tmp_path: Path):
    (tmp_path / "main.py").write_text(textwrap.dedent(TUTORIAL))
    done = disttrain("run", "-n", "2", "main.py", "0", cwd=tmp_path, timeout=150)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "EADDRINUSE" not in out and "joined" not in out
    line = next(x for x in out.splitlines() if x.startswith("[rank1] disttrain: main.py:7: "))
    assert "init_method 'tcp://127.0.0.1:23456' is not the launcher's 127.0.0.1:" in line
    assert "world_size=4 where the launcher gave WORLD_SIZE=2; rank=0 where the launcher gave RANK=1" in line
    assert line.endswith("leave out init_method, rank and world_size (or pass init_method='env://'): "
                         "the launcher sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE")


def test_the_launchers_group_runs(tmp_path: Path):
    fixed = TUTORIAL.replace('init_method=dist_url, rank=int(sys.argv[1]), world_size=world_size',
                             'init_method="env://"')
    (tmp_path / "main.py").write_text(textwrap.dedent(fixed))
    done = disttrain("run", "-n", "2", "main.py", cwd=tmp_path, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(x.split()[-1] for x in done.stdout.splitlines() if "joined" in x) == ["0", "1"]
