"""The probe's first answers from a real ``disttrain agent`` process: a host that says hello and is
slow to import torch is waited for, not called unreachable; one that never says anything, or
never gets past torch's import, is named with the limit that ran out."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from disttrain.errors import DisttrainError
from disttrain.launch import probe
from disttrain.launch.probe import ask_facts, close_all, open_sessions
from disttrain.launch.transport import LocalTransport
from disttrain.wire import HostFacts, ProbeFacts

# Installed through sitecustomize in the agent's Python only: torch's import stalls there, as it
# does on a host whose cores are busy or whose disk is slow (the CI failure this file answers).
SLOW_TORCH = """
import os, sys, time

class SlowTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            time.sleep(float(os.environ["SLOW_TORCH_S"]))
        return None

sys.meta_path.insert(0, SlowTorch())
"""


@pytest.fixture
def slow_torch(tmp_path, monkeypatch):
    """``slow_torch(s)``: the agents started after it take ``s`` seconds more to import torch."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(site))
    return lambda seconds: monkeypatch.setenv("SLOW_TORCH_S", str(seconds))


def ask_one(transport, tmp_path, hello_s: float, note_after_s: float = 30):
    sessions = open_sessions([transport], python=sys.executable, master="127.0.0.1", port=None,
                             cwd=str(tmp_path), reach=False)
    try:
        (answer,) = ask_facts(sessions, hello_s, note_after_s=note_after_s)
    finally:
        close_all(sessions, grace_s=2)
    assert all(s.proc.poll() is not None for s in sessions)
    return answer


@pytest.mark.timeout(60)
def test_a_host_slow_to_import_torch_is_waited_for_not_called_unreachable(slow_torch, tmp_path, capfd):
    slow_torch(8)
    answer = ask_one(LocalTransport("node-a"), tmp_path, hello_s=3, note_after_s=4)
    assert isinstance(answer, ProbeFacts), answer
    assert answer.facts.versions["torch"] == torch.__version__
    assert capfd.readouterr().err == ("disttrain: note: still waiting for node-a after 4 s: "
                                      "its facts (torch's import there)\n")


@pytest.mark.timeout(60)
def test_a_host_stuck_in_torchs_import_is_named_with_the_cause(slow_torch, tmp_path, monkeypatch):
    slow_torch(60)
    monkeypatch.setattr(probe, "FACTS_TIMEOUT_S", 4)
    answer = ask_one(LocalTransport("node-a"), tmp_path, hello_s=2)
    assert isinstance(answer, DisttrainError)
    assert str(answer) == ("node-a: its Python started, but its facts (torch's import) took over 4 s: "
                           "is the host overloaded, or its disk slow?")


class Silent(LocalTransport):
    def argv(self, command):
        return [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.timeout(60)
def test_a_host_that_says_nothing_is_named_within_the_hello_limit(tmp_path, capfd):
    answer = ask_one(Silent("node-b"), tmp_path, hello_s=3, note_after_s=1)
    assert str(answer) == "node-b: no answer from its process within 3 s (the probe)"
    assert capfd.readouterr().err == ("disttrain: note: still waiting for node-b after 1 s: "
                                      "its hello (the connection, then its Python's start)\n")


FACTS = HostFacts(hostname="h", address="10.0.0.2", ifname="eth1", is_master=False, cpus=8, cuda_devices=0,
                  versions={"python": "3.11", "torch": "2.13", "nccl": None, "disttrain": "0.4.0"},
                  paths={}, cwd="/w", cwd_exists=True)


class OlderAgent(LocalTransport):
    """An agent of a disttrain before the hello: its facts come first."""

    def argv(self, command):
        line = ProbeFacts(facts=FACTS).to_line()
        return [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            print({line!r}, flush=True)
            sys.stdin.read()
        """)]


@pytest.mark.timeout(60)
def test_an_older_agent_without_the_hello_still_gets_its_facts_checked(tmp_path):
    answer = ask_one(OlderAgent("node-c"), tmp_path, hello_s=5)
    assert isinstance(answer, ProbeFacts) and answer.facts.versions["disttrain"] == "0.4.0"
