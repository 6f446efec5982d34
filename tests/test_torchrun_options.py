"""torchrun's options, checked against torch's own parser, through ``disttrain run --dry-run``.

A torch release that adds, renames or changes an option fails here first: disttrain's table
(``config/torchrun.py``) must describe every option of ``torch.distributed.run.get_args_parser()``,
and every spelling is run through the real CLI (a few ``--dry-run`` processes, each using one
spelling of every option), whose printed plan must carry the value with torchrun's meaning.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from conftest import cli_env, disttrain
from disttrain import torchcompat
from disttrain.config import torchrun
from disttrain.errors import UsageError
from disttrain.net import free_port

SCRIPT = Path(__file__).parent / "scripts" / "ranks_report.py"


def torch_options() -> dict[str, argparse.Action]:
    from torch.distributed.run import get_args_parser

    return {a.dest: a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"}


def test_the_table_is_torch_parser_option_for_option():
    theirs = torch_options()
    ours = torchrun.BY_DEST
    new = sorted(set(theirs) - set(ours))
    assert not new, f"torch's torchrun has options disttrain run does not know: {new}; add them to config/torchrun.py"
    newer = set(ours) - set(theirs)  # options of a newer torch of the range: refused here (tests/test_compat.py)
    assert newer <= set(torchcompat.OPTION_SINCE), f"config/torchrun.py lists options torch no longer has: {newer}"
    for dest, action in theirs.items():
        option = ours[dest]
        assert option.flags == tuple(action.option_strings), dest
        assert option.flag == (action.nargs == 0), dest
        assert option.choices == (tuple(action.choices) if action.choices else None), dest
        if action.type in (int, float):
            assert option.convert is action.type, dest
        if callable(action.type) and action.type not in (int, float, str):  # torch's comma list
            assert option.convert("a,,b,c") == action.type("a,,b,c"), dest
    # torch's own lists, copied where importing them would cost every command seconds
    from torch.distributed.elastic.events.handlers import _log_handlers

    assert set(torchrun.EVENT_LOG_HANDLERS) == set(_log_handlers)
    if "numa_binding" in theirs:
        from torch.numa.binding import AffinityMode

        assert set(torchrun.NUMA_MODES) == {mode.value for mode in AffinityMode}


def test_the_table_reads_pet_variables_like_torch():
    """torch reads PET_<dest> for every option with its env/check_env action."""
    from torch.distributed.argparse_util import check_env, env

    for dest, action in torch_options().items():
        if isinstance(action, (env, check_env)):
            assert torchrun.BY_DEST[dest].env == f"PET_{dest.upper()}"


# One value per option, with what the printed plan then holds; an option torch adds has no
# entry here, and the test below says so.
def _samples(tmp: Path, port: int) -> dict[str, tuple[str, object]]:
    return {
        "nnodes": ("1", ("nnodes", 1)),
        "nproc_per_node": ("2", ("world_size", 2)),
        "rdzv_backend": ("c10d", ("rdzv_backend", "c10d")),
        "rdzv_endpoint": (f"127.0.0.1:{port}", ("master_port", port)),
        "rdzv_id": ("JOB7", ("rdzv_id", "JOB7")),
        "rdzv_conf": ("join_timeout=99,read_timeout=30", ("rdzv_conf", {"join_timeout": "99", "read_timeout": "30"})),
        "max_restarts": ("2", ("max_restarts", 2)),
        "monitor_interval": ("0.5", ("agent.monitor_interval_s", 0.5)),
        "start_method": ("fork", ("agent.start_method", "fork")),
        "event_log_handler": ("console", ("agent.event_log_handler", "console")),
        "role": ("trainer", ("agent.role", "trainer")),
        "log_dir": (str(tmp / "logs"), ("agent.torchrun_log_dir", str(tmp / "logs"))),
        "redirects": ("1", ("agent.redirects", "1")),
        "tee": ("0:3,1:2", ("agent.tee", "0:3,1:2")),
        "local_ranks_filter": ("1", ("agent.local_ranks_filter", [1])),
        "duplicate_stdout_filters": ("loss,,acc,step", ("agent.duplicate_stdout_filters", ["loss,acc", "step"])),
        "duplicate_stderr_filters": ("warn", ("agent.duplicate_stderr_filters", ["warn"])),
        "node_rank": ("0", ("nodes.0.node_rank", 0)),
        "master_addr": ("127.0.0.1", ("master_addr", "127.0.0.1")),
        "master_port": (str(port), ("master_port", port)),
        "local_addr": ("127.0.0.1", ("nodes.0.address", "127.0.0.1")),
        "logs_specs": ("dt_test_specs", ("agent.logs_specs", "dt_test_specs")),
        "numa_binding": ("socket", ("agent.numa_binding", "socket")),
        "signals_to_handle": ("SIGTERM,SIGUSR1", ("agent.signals_to_handle", "SIGTERM,SIGUSR1")),
        "shutdown_timeout": ("7", ("stop_grace_s", 7)),
        "virtual_local_rank": (None, ("agent.virtual_local_rank", True)),
        "log_line_prefix_template": ("<${rank}> ", ("agent.log_line_prefix_template", "<${rank}> ")),
        "run_path": (None, ("run_path", True)),
        "standalone": (None, ("rdzv_backend", "static")),
        "module": (None, ("argv.-2", "-m")),
        "no_python": (None, ("argv.0", "/bin/sh")),
    }


# Flags that change what runs or where: each gets a command of its own (with the others off).
_ALONE = {"standalone": ["-m", "json.tool"], "module": ["json.tool"], "no_python": ["/bin/sh", "-c", "true"]}


def _get(plan: dict, path: str):
    value = plan
    for part in path.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


@pytest.fixture
def logs_specs_entry_point(tmp_path, monkeypatch) -> dict[str, str]:
    """An installed package's torchrun.logs_specs entry point (torch's default class under a name)."""
    site = tmp_path / "site"
    info = site / "dt_test_specs-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dt-test-specs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\ndt_test_specs = torch.distributed.elastic.multiprocessing:DefaultLogsSpecs\n")
    env = cli_env()
    env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    return env


def _commands(samples: dict, tmp_path: Path) -> list[tuple[list[str], dict[str, tuple[str, object]]]]:
    """Every spelling of every option, in as few command lines as the longest list of spellings;
    the flags that change what runs in commands of their own."""
    # this torch's options; --print-completion prints and exits (tests/test_compat.py)
    options = [o for o in torchrun.OPTIONS if o.dest not in _ALONE and o.dest in torch_options()
               and o.dest != "print_completion"]
    commands = []
    width = max(len(o.flags) + (o.dest == "nproc_per_node") for o in options)
    for k in range(width):
        argv, expect = [], {}
        for option in options:
            spellings = ("-n", *option.flags) if option.dest == "nproc_per_node" else option.flags
            value, expected = samples[option.dest]
            argv += [spellings[k % len(spellings)]] + ([] if value is None else [value])
            expect[option.dest] = expected
        commands.append(([*argv, str(SCRIPT), str(tmp_path)], expect))
    for dest, rest in _ALONE.items():
        for spelling in torchrun.BY_DEST[dest].flags:
            commands.append(([spelling, "-n", "1", *rest], {dest: samples[dest][1]}))
    return commands


@pytest.mark.timeout(240)
def test_every_spelling_of_every_torchrun_option_reaches_the_plan(tmp_path, logs_specs_entry_point):
    port = free_port()
    samples = _samples(tmp_path, port)
    missing = [dest for dest in torch_options() if dest not in samples and dest != "print_completion"]
    assert not missing, f"no sample value for torch's new option(s) {missing}: add one here and in config/torchrun.py"
    seen: set[str] = set()
    for argv, expect in _commands(samples, tmp_path):
        result = disttrain("run", "--dry-run", *argv, env=logs_specs_entry_point, cwd=tmp_path)
        assert result.returncode == 0, (argv, result.stderr)
        assert "Traceback" not in result.stderr
        plan = json.loads(result.stdout)
        for dest, (path, value) in expect.items():
            assert _get(plan, path) == value, (dest, argv)
        seen.update(a for a in argv if a.startswith("-"))
    spellings = {s for o in torchrun.OPTIONS if o.dest in torch_options() and o.dest != "print_completion"
                 for s in o.flags} | {"-n"}
    assert spellings <= seen, spellings - seen


@pytest.mark.timeout(120)
def test_options_come_from_pet_variables_and_the_command_line_wins(tmp_path):
    env = cli_env(PET_NPROC_PER_NODE="2", PET_ROLE="fromenv", PET_MONITOR_INTERVAL="0.25", PET_TEE="3",
                  PET_VIRTUAL_LOCAL_RANK="1", PET_MAX_RESTARTS="1", PET_RDZV_CONF="last_call_timeout=4")
    result = disttrain("run", "--dry-run", str(SCRIPT), str(tmp_path), env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["world_size"] == 2 and plan["max_restarts"] == 1
    assert plan["agent"]["role"] == "fromenv" and plan["agent"]["monitor_interval_s"] == 0.25
    assert plan["agent"]["tee"] == "3" and plan["agent"]["virtual_local_rank"] is True
    assert plan["rdzv_conf"] == {"last_call_timeout": "4"}
    result = disttrain("run", "--dry-run", "--nproc_per_node=1", "--role", "cli", str(SCRIPT), str(tmp_path),
                       env=env, cwd=tmp_path)
    plan = json.loads(result.stdout)
    assert plan["world_size"] == 1 and plan["agent"]["role"] == "cli"
    result = disttrain("run", "--dry-run", str(SCRIPT), env=cli_env(PET_STANDALONE="yes"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["disttrain: error: PET_STANDALONE must be 0 or 1 (as torchrun reads "
                                                  "it), got 'yes'"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2:1"], "--nnodes 2:1: need 1 <= MIN <= MAX"),
    (["--nnodes", "x"], "--nnodes takes a node count N or a range MIN:MAX"),
    (["--nnodes", "1:2", "--rdzv-backend", "static"], "needs a dynamic rendezvous"),
    (["--tee", "5"], "--tee takes 0 (none), 1 (stdout), 2 (stderr), 3 (both)"),
    (["--rdzv-conf", "join_timeout"], "--rdzv-conf takes key=value pairs"),
    (["--rdzv-endpoint", "h:99999"], "the port must be in 1..65535"),
    (["--signals-to-handle", "SIGNOPE"], "'SIGNOPE' is not one"),
    (["--start-method", "thread"], "--start-method must be one of spawn, fork, forkserver, got 'thread'"),
    (["--numa-binding", "all"], "--numa-binding must be one of node, socket, exclusive, core-complex"),
    (["--logs-specs", "nope"], "--logs-specs nope: no such entry point"),
    (["--no-python", "-m"], "--no-python runs SCRIPT as a program, -m as a Python module"),
    (["--standalone", "--nnodes", "2"], "--standalone is one node"),
    (["--nproc-per-node", "xpu"], "--nproc-per-node xpu: disttrain starts no XPU workers"),
    (["--stop-grace", "3", "--shutdown-timeout", "4"], "are the same setting: give one"),
    (["--local-ranks-filter", "a"], "--local-ranks-filter takes local ranks"),
])
def test_bad_torchrun_values_are_one_line_and_exit_2(tmp_path, args, message):
    result = disttrain("run", "--dry-run", *args, str(SCRIPT), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("kw, rdzv_backend, addr, port, said", [
    ({}, "static", None, None, ""),
    ({"nnodes": (1, 2)}, "c10d", "127.0.0.1", 29400, "every node must be this machine"),
    ({"nnodes": (2, 2), "master_addr": "10.0.0.1"}, "static", "10.0.0.1", 29500, ""),
    ({"nnodes": (2, 2), "endpoint": "10.0.0.1", "rdzv_backend": "c10d"}, "c10d", "10.0.0.1", 29400, ""),
    ({"nnodes": (2, 2), "endpoint": "h:1234", "master_addr": "x", "rdzv_backend": "c10d"}, "c10d", "h", 1234,
     "--master-addr ignored"),
    ({"nnodes": (2, 2), "endpoint": "[::1]:7", "rdzv_backend": "c10d", "node_rank": 1}, "c10d", "::1", 7,
     "--node-rank 1 ignored"),
    ({"standalone": True, "endpoint": "h:1", "rdzv_backend": "c10d"}, "static", None, None, "ignored (one node"),
])
def test_rendezvous_follows_torchruns_rules(kw, rdzv_backend, addr, port, said):
    args = {"rdzv_backend": None, "endpoint": None, "master_addr": None, "master_port": None, "nnodes": (1, 1),
            "node_rank": 0, "standalone": False, **kw}
    rdzv = torchrun.resolve_rendezvous(**args)
    assert (rdzv.rdzv_backend, rdzv.master_addr, rdzv.master_port) == (rdzv_backend, addr, port)
    assert said in " ".join(rdzv.notes) and bool(said) == bool(rdzv.notes)


def test_value_formats_are_torchruns():
    assert torchrun.parse_nnodes("3") == (3, 3) and torchrun.parse_nnodes("1:4") == (1, 4)
    assert torchrun.std_of("3", 5) == 3 and torchrun.std_of("0:1,1:2", 1) == 2 and torchrun.std_of("0:1", 3) == 0
    assert torchrun.split_filters("a,,b,c") == ["a,b", "c"]
    assert torchrun.parse_local_ranks("") is None and torchrun.parse_local_ranks("2,0") == (0, 2)
    from torch.distributed.elastic.multiprocessing.api import Std

    for text in ("0", "3", "0:3,1:0,2:1"):  # what torch's own parser takes, disttrain takes
        assert torchrun.check_std(text, where="--tee") == text and Std.from_str(text) is not None
    with pytest.raises(UsageError):
        torchrun.check_std("0:4", where="--tee")
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config, parse_rendezvous_endpoint

    for text in ("a=1,b = 2", ""):
        assert torchrun.parse_rdzv_conf(text) == _parse_rendezvous_config(text)
    for text in ("host:29401", "host", "10.0.0.1:5", "[::1]:7", "[fe80::1]"):
        assert torchrun.parse_endpoint(text, default_port=29400) == parse_rendezvous_endpoint(text, 29400)


def test_cli_parser_takes_no_option_torch_lacks_under_torchs_names():
    """disttrain's own options never shadow a torchrun spelling with another meaning."""
    from disttrain.cli.main import build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    by_flag = {flag: action.dest for action in run._actions for flag in action.option_strings}
    for option in torchrun.OPTIONS:
        for flag in option.flags:
            assert by_flag[flag] == option.dest, flag
    assert sys.executable  # the parser was built without importing torch.distributed.run


def test_docs_list_every_torchrun_option():
    text = (Path(__file__).resolve().parent.parent / "docs" / "torchrun.md").read_text()
    missing = [option.flags[0] for option in torchrun.OPTIONS if f"`{option.flags[0]}" not in text
               and f"{option.flags[0]} " not in text]
    assert not missing, f"docs/torchrun.md does not describe {missing}"


def test_what_reaches_the_terminal(tmp_path):
    """--ranks (global), --local-ranks-filter (local), --redirects without --tee: off the terminal."""
    from torch.distributed.elastic.multiprocessing.api import Std

    from disttrain.agent.logs import RankLogs
    from disttrain.config.launch import AgentOptions

    logs = RankLogs(str(tmp_path), shown_ranks=(3, 4), options=AgentOptions(
        local_ranks_filter=(0, 1), redirects="0:3,1:2", tee="0:1"))
    # (local rank, global rank) on a second node of two ranks each, under c10d: ranks 2 and 3 here
    assert not logs.shown(0, 2, Std.OUT)  # --ranks 3,4
    assert logs.shown(1, 3, Std.OUT) and not logs.shown(1, 3, Std.ERR)  # local rank 1: stderr redirected
    plain = RankLogs(str(tmp_path), options=AgentOptions(redirects="3", tee="1"))
    assert plain.shown(0, 0, Std.OUT) and not plain.shown(0, 0, Std.ERR)
    assert RankLogs(str(tmp_path)).shown(5, 9, Std.ERR)


def test_c10d_host_is_decided_by_the_nodes_addresses_when_started_by_hand():
    from disttrain.agent.elastic_config import rdzv_configs
    from disttrain.plan.launch import NodeFacts, make_plan

    spec = dict(entry="t.py", nproc_per_node=1, nnodes=2, master_addr="10.0.0.1", master_port=29400,
                rdzv_backend="c10d", rdzv_timeout_s=40)
    by_hand = make_plan(torchrun_spec(**spec), NodeFacts(name="h", cpus=2, address="10.0.0.2"), python="/py",
                        master_port=29400, run_id="r", run_dir="/r", inherited_env={})
    node = by_hand.nodes[0]
    assert rdzv_configs(by_hand, node, hosts_store=lambda addr: addr == "10.0.0.2") == {
        "join_timeout": 40, "is_host": False}
    assert rdzv_configs(by_hand, node, hosts_store=lambda addr: addr == "10.0.0.1")["is_host"] is True
    assert "is_host" not in rdzv_configs(by_hand, node, hosts_store=lambda addr: None)  # loopback: torch's way
    forced = make_plan(torchrun_spec(**spec, rdzv_conf={"is_host": "1", "join_timeout": "9"}),
                       NodeFacts(name="h", cpus=2), python="/py", master_port=29400, run_id="r", run_dir="/r",
                       inherited_env={})
    assert rdzv_configs(forced, forced.nodes[0], hosts_store=lambda addr: False) == {"join_timeout": "9",
                                                                                     "is_host": "1"}
    assert by_hand.rendezvous_id == "disttrain-10.0.0.1-29400" and forced.rendezvous_id == by_hand.rendezvous_id
    assert make_plan(torchrun_spec(**spec, rdzv_id="JOB"), NodeFacts(name="h", cpus=2), python="/py",
                     master_port=1, run_id="r", run_dir="/r", inherited_env={}).rendezvous_id == "JOB"


def torchrun_spec(**kw):
    from disttrain.config.launch import LaunchSpec

    return LaunchSpec(**kw)


def test_numa_binding_choice():
    from disttrain.agent.elastic_config import numa_choice

    assert numa_choice(None, cuda_devices=8, numactl="/usr/bin/numactl") == (None, None)
    assert numa_choice("node", cuda_devices=8, numactl="/usr/bin/numactl") == ("node", None)  # the GPU path
    mode, note = numa_choice("socket", cuda_devices=0, numactl="/usr/bin/numactl")
    assert mode is None and "no CUDA GPU" in note
    mode, note = numa_choice("node", cuda_devices=2, numactl=None)
    assert mode is None and "needs numactl" in note
