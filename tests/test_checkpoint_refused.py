"""A checkpoint that weights_only refuses is reported as refused and stops the run.

Before: torch 2.13 words the refusal "... module posix is blocked", which was read as damage;
the run skipped it with a warning, resumed from an older step and exited 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _launch import worker_env
from disttrain.runtime import checkpoint

SCRIPT = """
import torch, disttrain
disttrain.init()
state = disttrain.resume(model=torch.nn.Linear(2, 2), every=1)
for epoch in disttrain.epochs(2):
    for _ in state.steps(range(3)):
        pass
disttrain.print0(f"resumed from {state.resumed_from}")
"""


class Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def run(tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "disttrain", "run", "-n", "1", "--checkpoint-dir", str(tmp_path / "ck"),
         str(tmp_path / "train.py")],
        capture_output=True, text=True, timeout=120, env=worker_env({"DISTTRAIN_HOME": str(tmp_path / "home")}))


@pytest.mark.timeout(180)
def test_hostile_newest_checkpoint_stops_the_run_naming_file_and_global(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr
    newest = checkpoint.latest(tmp_path / "ck")
    marker = tmp_path / "PWNED"
    torch.save({"step": 99, "model": Hostile(marker)}, newest / "state.pt")

    second = run(tmp_path)
    assert second.returncode == 1
    line = f"[rank0] disttrain: error: checkpoint {newest / 'state.pt'} refused: it tries to load posix.system"
    assert line in second.stderr
    assert "Traceback" not in second.stderr  # the message is the whole story
    assert "skipping damaged" not in second.stderr and "resumed from" not in second.stdout
    assert not marker.exists()

    # The user's explicit way to skip it: move it aside; the run resumes from the one before.
    newest.rename(tmp_path / "quarantined")
    third = run(tmp_path)
    assert third.returncode == 0, third.stderr
    assert "resumed from 5" in third.stdout
