"""``disttrain bench``: the recommendation on given numbers, the table and JSON, reading a
count's output, stopping a count that hangs, bad input, and two real runs of a tiny script."""

from __future__ import annotations

import json
import sys
import textwrap

import psutil
import pytest

from conftest import SCRIPTS, cli_env, disttrain
from disttrain.cli.main import main
from disttrain.config.launch import LaunchSpec
from disttrain.scaling import report, runner
from disttrain.scaling.report import Measurement, recommend, scaling

TINY = str(SCRIPTS / "bench_tiny.py")


def measured(*rates: tuple[int, float | None], hosts: int = 1, global_batch: int = 128):
    """Measurements for ``(nproc, samples/s)`` pairs; None: the count failed."""
    return [
        Measurement(nproc=n, world_size=n * hosts, batch_per_process=global_batch // (n * hosts),
                    samples_per_s=rate, source=report.STEP_TIMER,
                    error=None if rate else "exit 1: boom")
        for n, rate in rates
    ]


# --------------------------------------------------------------------------- recommendation


def test_the_seed_chapters_laptop():
    """44 s -> 30 s -> a bit slower, on 4 cores: 2 processes, and 4 oversubscribe."""
    epoch = 60000
    rows = scaling(measured((1, epoch / 44), (2, epoch / 30), (4, epoch / 31)))
    assert [round(r.speedup, 2) for r in rows] == [1.0, 1.47, 1.42]
    assert [r.ideal for r in rows] == [1.0, 2.0, 4.0]
    assert [round(r.efficiency, 2) for r in rows] == [1.0, 0.73, 0.35]
    rec = recommend(rows, cpus=4)
    assert rec.nproc == 2
    assert rec.reasons[0] == "2 processes: the most samples/s (2,000)"
    assert rec.reasons[1].startswith("4 processes: 3% slower; 4 processes oversubscribe 4 cores")
    assert "efficiency drops below 50% (35%)" in rec.reasons[1]


def test_a_smaller_count_within_5_percent_wins():
    rows = scaling(measured((1, 600), (2, 1150), (4, 1200)))
    rec = recommend(rows, cpus=32)
    assert rec.nproc == 2
    assert "within 5% of the fastest (4 processes, 1,200 samples/s)" in rec.reasons[0]
    assert rec.reasons[1] == "4 processes: only 4% faster"  # 32 cores: nothing oversubscribed


def test_still_scaling_at_the_largest_count_suggests_more():
    rec = recommend(scaling(measured((1, 1000), (2, 1950))), cpus=16)
    assert rec.nproc == 2
    assert rec.reasons[-1].endswith("try -n 4 too")
    # ...but not when the host has no room for more
    assert not recommend(scaling(measured((1, 1000), (2, 1950))), cpus=6).reasons[-1].endswith("too")


def test_a_measurement_that_overrules_n_auto_says_so():
    rec = recommend(scaling(measured((1, 700), (2, 2300))), cpus=2)
    assert rec.nproc == 2
    assert rec.reasons[-1] == ("`-n auto` would start 1 here (one per GPU, or per two cores); "
                               "for this script pass -n 2")


def test_reasons_agree_with_the_rounded_numbers_they_show():
    # 4,647 vs 4,635 samples/s: 0.3% slower and 49.9% efficient, printed as 0% and 50%
    rec = recommend(scaling(measured((1, 4647), (2, 4635))), cpus=2)
    assert rec.nproc == 1
    assert rec.reasons[1].startswith("2 processes: no faster; 2 processes oversubscribe 2 cores")
    assert "efficiency drops" not in rec.reasons[1]


def test_gpus_limit_instead_of_cores():
    rec = recommend(scaling(measured((1, 1000), (2, 1900), (4, 1700))), cpus=2, gpus=2)
    assert rec.nproc == 2
    assert "4 processes share 2 GPUs" in rec.reasons[1]
    assert "oversubscribe" not in " ".join(rec.reasons)


def test_failed_counts_are_named_and_the_baseline_is_the_smallest_that_finished():
    rows = scaling(measured((1, None), (2, 1000), (4, 1500)))
    assert rows[0].speedup is None and rows[1].speedup == 1.0
    assert rows[2].ideal == 2.0 and rows[2].efficiency == 0.75
    rec = recommend(rows, cpus=64)
    assert rec.nproc == 4
    assert rec.reasons[-1] == "1 process failed: exit 1: boom"


def test_nothing_finished():
    rec = recommend(scaling(measured((1, None), (2, None))), cpus=2)
    assert rec.nproc is None
    assert rec.reasons[0].startswith("no process count finished")
    assert len(rec.reasons) == 3


def test_hosts_count_per_host():
    rows = scaling(measured((1, 1000), (2, 1040), hosts=2))
    rec = recommend(rows, cpus=2, hosts=2)
    assert rec.nproc == 1
    assert rec.reasons[0].startswith("1 process per host (2 in all)")
    assert rec.reasons[1].startswith("2 processes per host (4 in all): only 4% faster; 2 processes oversubscribe 2 cores")



def runs_of(nproc: int, *rates: float, others: tuple[float, ...] = (), hosts: int = 1):
    """One count's repeats, as run_all records them, combined."""
    world = nproc * hosts
    return report.combine([
        Measurement(nproc=nproc, world_size=world, batch_per_process=128 // world, samples_per_s=rate,
                    source=report.STEP_TIMER, others_cores=(others[k],) if others else ())
        for k, rate in enumerate(rates)])


def test_more_than_linear_is_noise_and_the_recommendation_says_it_cannot_be_trusted():
    """Issue 27: "6.35x, 317% efficiency" for 2 processes on 2 cores, reported as a result."""
    rows = scaling([runs_of(1, 100), runs_of(2, 635)])
    assert [r.noise for r in rows][0] == () and rows[1].noise[0].startswith(
        "318% efficiency: 2 processes cannot be more than 2x as fast as 1; it ran slowed by other work")
    rec = recommend(rows, cpus=2)
    assert not rec.trusted and rec.nproc == 2
    assert rec.reasons[0].startswith("not to be trusted: the numbers are noise (marked !)")
    assert rec.reasons[1].startswith("2 processes: 318% efficiency")
    table = report.format_table(rows, rec).splitlines()
    assert table[2].split()[-4:] == ["318%", "!", "step", "timer"] and "!" not in table[1]
    assert "recommended: -n 2 for this script on this machine (NOT TRUSTED: noisy measurements)" in table
    assert report.to_json(rows, rec)["results"][1]["noise"] == list(rows[1].noise)


def test_repeats_keep_the_best_run_and_runs_far_apart_are_noise():
    steady, jumpy = runs_of(1, 1000, 980), runs_of(2, 1900, 1500)
    assert (steady.samples_per_s, steady.runs) == (1000, (1000, 980)) and round(steady.spread, 2) == 0.02
    rows = scaling([steady, jumpy])
    assert rows[0].noise == () and rows[1].noise == ("its 2 runs differ by 21%",)
    assert rows[1].speedup == 1.9 and not recommend(rows, cpus=8).trusted
    half_failed = report.combine([runs_of(2, 1900),
                                  Measurement(nproc=2, world_size=2, batch_per_process=64, error="exit 1: boom")])
    assert half_failed.ok and half_failed.notes == ("1 of 2 runs failed: exit 1: boom",)
    assert report.format_table(scaling([steady]), recommend(scaling([steady]), cpus=8)).splitlines()[1].split()[3:6] \
        == ["1,000", "2", "2%"]


def test_a_change_of_the_machines_other_load_is_noise():
    quiet = runs_of(1, 1000, 1000, others=(0.1, 0.2))
    busy = runs_of(2, 1500, 1480, others=(1.0, 1.1))  # others took a core while -n 2 ran
    rows = scaling([quiet, busy])
    assert rows[1].noise == ("the machine's other work changed while it was measured (0.1 to 1.1 cores busy)",)
    assert not recommend(rows, cpus=4).trusted
    steady = scaling([quiet, runs_of(2, 1500, 1480, others=(0.3, 0.2))])
    assert steady[1].noise == () and recommend(steady, cpus=4).trusted


def test_counts_are_interleaved_and_each_given_once():
    from disttrain.scaling.bench import parse_counts, rounds

    assert parse_counts("2,2") == (2,) and parse_counts("4,1,2,1") == (1, 2, 4)
    assert rounds((1, 2, 4), 2) == [1, 2, 4, 4, 2, 1]
    assert rounds((1, 2), 3) == [1, 2, 2, 1, 1, 2] and rounds((2,), 1) == [2]


def test_table_and_json():
    ms = measured((1, 5200), (2, 3900), (4, None))
    ms[1] = Measurement(**{**ms[1].__dict__, "notes": ("shared note",)})
    ms[0] = Measurement(**{**ms[0].__dict__, "notes": ("shared note",)})
    rows = scaling(ms)
    rec = recommend(rows, cpus=2)
    table = report.format_table(rows, rec, title="T").splitlines()
    assert table[0] == "T"
    assert table[1].split() == ["processes", "threads", "each", "batch/process", "samples/s", "runs", "spread",
                                "speed-up", "efficiency", "noise", "measured", "by"]
    assert table[2].split()[:8] == ["1", "-", "128", "5,200", "1", "-", "1.00x", "100%"]
    assert table[3].split()[:8] == ["2", "-", "64", "3,900", "1", "-", "0.75x", "38%"]
    assert table[4].split()[:5] == ["4", "-", "32", "-", "-"] and "FAILED: exit 1: boom" in table[4]
    assert "note (-n 1,2): shared note" in table  # once, naming the counts
    assert "recommended: -n 1 for this script on this machine" in table
    assert any("2 processes oversubscribe 2 cores" in line for line in table)

    data = report.to_json(rows, rec, script="x.py")
    json.dumps(data)  # serialisable as it is
    assert data["script"] == "x.py" and data["recommendation"]["nproc"] == 1
    first = data["results"][0]
    assert {"nproc", "world_size", "batch_per_process", "samples_per_s", "speedup", "runs", "spread",
            "others_cores", "noise", "ideal_speedup", "efficiency", "source", "error", "notes"} <= first.keys()
    assert data["recommendation"]["trusted"] is True
    assert data["results"][2]["error"] == "exit 1: boom" and data["results"][2]["speedup"] is None



def test_the_comm_split_comes_from_the_reference_runs_own_pairs_and_a_beaten_reference_is_flagged():
    """Issue 27: the reference (245 samples/s) below PowerSGD (1,110) and plain DDP (105): every
    ratio between runs was suspect. The split comes from the reference run's steps with and without
    sync side by side; a mode's rate above the reference's is flagged, never a reason to choose it."""
    from disttrain.scaling.comm import CommResult

    beaten = CommResult(nproc=1, world_size=2, global_batch=128, plain=105.0, compute_only=245.0,
                        compressed={"fp16": 420.0, "powersgd": 1110.0}, gradient_bytes=1_201_704, link_gbit=None,
                        paired={"compute_ms": 520.0, "comm_ms": 700.0, "pairs": 8})
    assert beaten.beaten_by == ("powersgd", 1110.0) and beaten.split.bound == "communication"
    # No accuracy measured: PowerSGD is fastest, but a mode is never chosen for speed alone.
    assert beaten.to_json()["comm_fraction"] == pytest.approx(700 / 1220) and beaten.to_json()["recommended"] == "none"
    assert beaten.to_json()["paired_steps"] == 8
    lines = beaten.lines()
    assert lines[0] == ("communication, 2 processes: step 1,220 ms = compute 520 ms + communication 700 ms "
                        "(57%): communication-bound")
    assert lines[1].startswith("  powersgd ran at 1,110 samples/s, above the compute reference's 245 (no gradient sync)")
    # A compute-bound job: its pairs show 3 ms of communication in a 120 ms step, whatever the
    # runs minutes apart read (plain DDP 38 % below the reference, under a busy machine in CI).
    compute = CommResult(nproc=1, world_size=2, global_batch=16, plain=3773.8, compute_only=6132.8,
                         compressed={"fp16": 6120.0}, gradient_bytes=10_280, link_gbit=0.05,
                         paired={"compute_ms": 117.0, "comm_ms": 3.0, "pairs": 8})
    assert compute.beaten_by is None and compute.split.bound == "compute"
    assert compute.split.comm_s == pytest.approx(0.003)
    # No pairs measured (a reference that failed, or a script without a prepared loader): no split.
    assert CommResult(nproc=1, world_size=2, global_batch=16, plain=100.0, compute_only=110.0, compressed={},
                      gradient_bytes=None, link_gbit=None).split is None


# --------------------------------------------------------------------------- reading a count


def test_parse_output_prefers_the_step_timer_and_strips_prefixes():
    timer = '{"samples_per_s": 10.0, "steps": 4, "samples": 64, "complete": true}'
    out = "\n".join([
        "[rank0] some line",
        f"[node0 rank0] disttrain-bench: {timer}",
        '[rank0] {"train_samples_per_s": 3.0}',
    ])
    assert runner.parse_output(out) == (report.STEP_TIMER, json.loads(timer))
    assert runner.parse_output('[rank0] {"train_samples_per_s": 3.0}\n[rank0] {"other": 1}') == \
        (report.SCRIPT_SUMMARY, {"train_samples_per_s": 3.0})
    assert runner.parse_output("[rank0] [not json\nplain text") is None


def count_run(stdout="", stderr="", rc=0, timed_out=False):
    return runner.CountRun(rc, stdout, stderr, 1.0, timed_out)


def test_measurement_from_the_summary_warns_about_a_batch_flag_it_ignores():
    out = '{"train_samples_per_s": 900.0, "global_batch_size": 256, "world_size": 2, "epoch_seconds": [2.0]}'
    m = runner.measurement(count_run(out), nproc=2, world_size=2, batch_per_process=64, timeout_s=9)
    assert m.ok and m.samples_per_s == 900.0 and m.source == report.SCRIPT_SUMMARY and m.seconds == 2.0
    assert any("global batch of 256, not 128" in note for note in m.notes)
    assert any("--steps and --warmup had no effect" in note for note in m.notes)


def test_measurement_failures():
    stderr = ("disttrain: 2 workers (gloo) on vm, rendezvous 127.0.0.1:1; logs: /runs/x\n"
              "disttrain: rank 1 on vm exited with code 3 (pid 9); the other ranks were stopped\n")
    m = runner.measurement(count_run(stderr=stderr, rc=3), nproc=2, world_size=2,
                           batch_per_process=8, timeout_s=9)
    assert not m.ok and m.exit_code == 3 and m.log_dir == "/runs/x"
    assert m.error == "exit 3: rank 1 on vm exited with code 3 (pid 9); the other ranks were stopped"
    m = runner.measurement(count_run(rc=-15, timed_out=True), nproc=1, world_size=1,
                           batch_per_process=8, timeout_s=9)
    assert m.error == "timed out after 9 s (--timeout)"
    short = 'disttrain-bench: {"samples_per_s": null, "steps": 0, "steps_run": 3, "warmup": 5, "complete": false}'
    m = runner.measurement(count_run(short), nproc=1, world_size=1, batch_per_process=8, timeout_s=9)
    assert "ran 3 training steps per process" in m.error
    m = runner.measurement(count_run("nothing useful"), nproc=1, world_size=1,
                           batch_per_process=8, timeout_s=9)
    assert m.error.startswith("no measurement")


@pytest.mark.timeout(60)
def test_a_count_that_hangs_is_stopped_with_everything_it_started(monkeypatch, tmp_path):
    """Like torch's agent, the fake launcher puts its worker in a session of its own."""
    monkeypatch.setattr(runner, "TERMINATE_GRACE_S", 1.0)
    pid_file = tmp_path / "worker.pid"
    launcher = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a launcher too stuck to stop
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                  start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(worker.pid))
        print("started", flush=True)
        time.sleep(120)
    """)
    result = runner.run_count([sys.executable, "-c", launcher], LaunchSpec(entry="x.py"), timeout_s=2)
    assert result.timed_out and "started" in result.stdout
    worker = int(pid_file.read_text())
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


# --------------------------------------------------------------------------- the command


def usage_error(capsys, *argv: str) -> str:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize(("argv", "fragment"), [
    ([TINY, "-n", "1,x"], "-n/--nproc: expected process counts like 1,2,4"),
    ([TINY, "-n", "0"], "each at least 1"),
    ([TINY, "-n", "1,3"], "--global-batch 128 cannot be split evenly over 3 processes: pick a multiple of 3"),
    ([TINY, "-n", "2", "--hosts", "a,b,c", "--global-batch", "8"],
     "cannot be split evenly over 6 processes on 3 hosts: pick a multiple of 6"),
    ([TINY, "--", "--batch-size", "4"], "--batch-size is in the script's arguments"),
    ([TINY, "--batch-arg=--per-proc", "--", "--per-proc=4"], "--per-proc=4 is in the script's"),
    ([TINY, "--samples", "5"], "unrecognized arguments: --samples 5; the script's own arguments go after `--`"),
    (["missing.py"], "script not found: missing.py"),
    ([str(SCRIPTS)], f"{SCRIPTS} is a directory, not a script"),
    ([TINY, "--env", "oops"], "--env oops: oops is not set in this environment"),
    ([TINY, "--steps", "0"], "--steps must be at least 1"),
    ([TINY, "--timeout", "0"], "--timeout must be more than 0 seconds"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    assert fragment in usage_error(capsys, *argv)


def test_context_notes(monkeypatch):
    from disttrain.scaling import bench

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert bench.context_notes(busy=None) == []
    (note,) = bench.context_notes(busy=(3.84, 2))
    assert note.startswith("this machine was already busy (load average 3.8 on 2 cores)")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert bench.context_notes(busy=None)[0].startswith("OMP_NUM_THREADS=3 is set here")


def test_threads_per_process_as_disttrain_run_sets_them(monkeypatch):
    from disttrain.placement import usable_cpus
    from disttrain.scaling import bench

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = bench.BenchSpec(launch=LaunchSpec(entry=TINY), counts=(1, 2), hosts=(),
                           global_batch=8, batch_arg="--batch-size", steps=1, warmup=0, timeout_s=9)
    assert bench.expected_threads(spec, 1) == usable_cpus()
    assert bench.expected_threads(spec, 2) == max(1, usable_cpus() // 2)
    pinned = bench.BenchSpec(**{**spec.__dict__, "launch": LaunchSpec(entry=TINY, env={"OMP_NUM_THREADS": "3"})})
    assert bench.expected_threads(pinned, 2) == 3
    remote = bench.BenchSpec(**{**spec.__dict__, "hosts": ("a", "b")})
    assert bench.expected_threads(remote, 1) is None  # the workers will say


def test_plot_without_matplotlib_fails_before_running(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    line = usage_error(capsys, TINY, "-n", "1", "--plot", "out.png")
    assert "--plot needs matplotlib" in line and "pip install 'disttrain[plot]'" in line


def test_dry_run_shows_each_counts_spec_and_host_flags_but_no_env_value(capsys):
    assert main(["bench", "-n", "1,2", "--hosts", "a,b", TINY, "--global-batch", "64",
                 "--ssh-option", "Port=2222", "--env", "K=s3cr3t", "--dry-run", "--json",
                 "--steps", "7", "--", "--samples", "10"]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t" not in out  # the spec travels on the count's stdin; printed by name only
    one, two = json.loads(out)
    assert one["command"][1:4] == ["-m", "disttrain", "run-spec"]
    assert one["command"][4:] == ["--hosts", "a,b", "--ssh-option", "Port=2222"]
    assert one["spec"]["nproc_per_node"] == 1 and two["spec"]["nproc_per_node"] == 2
    assert one["spec"]["env"] == ["DISTTRAIN_BENCH_STEPS", "DISTTRAIN_BENCH_WARMUP", "K"]
    assert one["spec"]["ranks"] == [0]
    # 64 over 2 hosts x 1, then 2 hosts x 2; the script's arguments last
    assert one["spec"]["entry"] == TINY
    assert one["spec"]["script_args"] == ["--batch-size", "32", "--samples", "10"]
    assert two["spec"]["script_args"] == ["--batch-size", "16", "--samples", "10"]


def test_a_count_gets_its_spec_values_on_stdin_not_argv():
    from disttrain.scaling import bench

    spec = bench.BenchSpec(launch=LaunchSpec(entry=TINY, env={"K": "v", "DISTTRAIN_BENCH_STEPS": "9"}), counts=(2,),
                           hosts=(), global_batch=8, batch_arg="--batch-size", steps=3, warmup=1, timeout_s=9)
    count = spec.count(2, grad_compression="fp16")
    assert count.env == {"DISTTRAIN_BENCH_STEPS": "9", "DISTTRAIN_BENCH_WARMUP": "1", "K": "v"}  # the user's wins
    assert (count.nproc_per_node, count.grad_compression, count.script_args) == (2, "fp16", ("--batch-size", "4"))
    assert LaunchSpec.from_json(count.to_json()) == count
    assert "v" not in " ".join(spec.command()[4:])


def test_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from disttrain.scaling.plot import write_plot

    path = write_plot(tmp_path / "s.png", scaling(measured((1, 1000), (2, 1500), (4, None))), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["s.png"]
    noisy = scaling([runs_of(1, 100), runs_of(2, 635)])
    assert write_plot(tmp_path / "noisy", noisy, title="t") == tmp_path / "noisy.png"  # the path written


def test_the_plot_title_fits_the_figure():
    from disttrain.scaling.plot import TITLE_CHARS, wrap_title

    headline = ("disttrain bench: examples/mnist_convnet.py --samples 20000 --epochs 3 --log-every 0, "
                "global batch 128 (vm: 2 cores, no GPU)")
    lines = wrap_title(headline).splitlines()
    assert len(lines) == 2 and all(len(line) <= TITLE_CHARS for line in lines)
    assert " ".join(lines) == headline


@pytest.mark.parametrize(("where", "fragment"), [
    ("/proc/x.png", "--plot /proc/x.png: cannot write in /proc"),
    ("/nonexistent/dir/x.png", "--plot /nonexistent/dir/x.png: the folder /nonexistent/dir does not exist"),
])
def test_a_plot_path_that_cannot_be_written_fails_before_running(capsys, where, fragment):
    pytest.importorskip("matplotlib")
    assert fragment in usage_error(capsys, TINY, "-n", "1", "--plot", where)


# --------------------------------------------------------------------------- real runs


@pytest.mark.timeout(120)
def test_bench_a_tiny_script_one_count_failing(tmp_path):
    """1 process fails on purpose; 2 processes are timed by the step timer all the same."""
    home = tmp_path / "home"
    result = disttrain("bench", TINY, "-n", "1,2", "--global-batch", "16", "--steps", "4",
                       "--warmup", "2", "--", "--timer", "--samples", "256", "--fail-at-world", "1",
                       timeout=110, env=cli_env(DISTTRAIN_HOME=str(home)))
    assert result.returncode == 1, result.stderr  # a count failed: the table still comes
    table = result.stdout.splitlines()
    assert table[1].split()[0] == "processes"
    assert table[2].split()[:5] == ["1", "1", "16", "-", "-"]  # cli_env: OMP_NUM_THREADS=1
    assert "FAILED: exit 3: rank 0 on" in table[2]
    # the speed-up's baseline is the smallest count that finished; its two runs (the default --repeat)
    assert table[3].split()[:3] == ["2", "1", "8"] and table[3].split()[4:5] == ["2"]
    assert table[3].split()[6:8] == ["1.00x", "100%"] and table[3].endswith("step timer (4 steps)")
    # interleaved: 1, 2, then 2, 1
    started = [line.split(",")[0] for line in result.stderr.splitlines() if "samples per process per step" in line]
    assert started == ["disttrain bench: 1 process (run 1 of 2)", "disttrain bench: 2 processes (run 1 of 2)",
                       "disttrain bench: 2 processes (run 2 of 2)", "disttrain bench: 1 process (run 2 of 2)"]
    # 16 samples a step, as asked: no note about the batch (only cli_env's OMP_NUM_THREADS,
    # and the load of a busy test machine, are noted)
    notes = [line for line in table if line.startswith("note")]
    assert any(line.startswith("note: OMP_NUM_THREADS=1 is set here") for line in notes)
    assert not any("samples per process" in line or line.startswith("note (") for line in notes)
    assert "recommended: -n 2" in result.stdout
    assert "1 process failed: exit 3" in result.stdout
    assert "logs: " + str(home / "runs") in result.stderr  # where to look
    left = [p for p in psutil.process_iter(["cmdline"])
            if any("bench_tiny.py" in part for part in (p.info["cmdline"] or []))]
    assert not left, left  # nothing of either count is still running


def test_the_mnist_example_is_timed_by_its_summary_line():
    """The fallback the README's table used, on the example's actual summary format."""
    line = ('[rank0] {"world_size": 2, "epochs": 1, "global_batch_size": 128, "train_samples": 6000, '
            '"val_samples": 1000, "train_samples_per_s": 3916.0, "epoch_seconds": [1.5], '
            '"train_loss": 0.7, "val_accuracy": 0.9}')
    m = runner.measurement(count_run(line), nproc=2, world_size=2, batch_per_process=64, timeout_s=9)
    assert m.ok and m.samples_per_s == 3916.0 and len(m.notes) == 1
