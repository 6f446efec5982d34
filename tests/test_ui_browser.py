"""``disttrain ui`` in headless Chromium: what a person checks on each page, after its scripts ran.

Real runs made by the real command (a finished run with checkpoints, a failed run, a hung run with its
verdict), a real tuning job (``disttrain tune run``, three trials), and the rig's elastic run as it was
while live (its folder recorded on the namespace rig: tests/data/ui_elastic/). The server is uvicorn in this process, the app
wrapped so that the test can see each request and act when the page asks for its update (the run ends
meanwhile); Chromium's ``--dump-dom`` gives the DOM after the page's scripts ran, ``--screenshot`` a
picture of it, kept as a test artifact (the folder is printed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_docs_browser import CHROMIUM, needs_chromium
from test_ui import elastic_run, rows, thousand_runs

from _launch import kill_tree
from conftest import HP_LOSS_SCRIPT, SCRIPTS, cli_env, disttrain, write
from disttrain import goodput
from disttrain.store import JobState, JobStore

pytest.importorskip("uvicorn")
pytest.importorskip("optuna")
pytestmark = [needs_chromium, pytest.mark.timeout(900)]

from disttrain.ui.server import Settings, create_app  # noqa: E402

# Added to each full page: how long it took to open (the browser's navigation timing), and its rows.
PROBE = b"""<script>
window.addEventListener("load", () => setTimeout(() => {
  const nav = performance.getEntriesByType("navigation")[0];
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({open_ms: nav.loadEventEnd - nav.startTime, response_ms: nav.responseEnd -
    nav.startTime, rows: document.querySelectorAll("tbody tr").length});
  document.body.appendChild(out);
}, 0));
</script>"""
PROBED = re.compile(r'<pre id="probe">(.*?)</pre>', re.S)
TUNE_SCRIPT = HP_LOSS_SCRIPT + """\
    print(f"loss: {loss:.6f}", flush=True)
"""


class Watched:
    """The app, with each request's path counted, ``on_request(path)`` called before it is answered, and
    :data:`PROBE` added to each full page."""

    def __init__(self, app) -> None:
        self.app, self.seen, self.on_request, self.probe = app, [], None, True

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.seen.append(scope["path"])
        if self.on_request is not None:
            self.on_request(scope["path"])
        start, body = None, []

        async def held(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            data = b"".join(body)
            if b"</body>" in data and self.probe:
                data = data.replace(b"</body>", PROBE + b"</body>")
            headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})

        await self.app(scope, receive, held)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A disttrain home holding the real runs and the tuning job (made once for the module)."""
    work = tmp_path_factory.mktemp("ui-home")
    home = work / "home"
    env = cli_env(DISTTRAIN_HOME=str(home), DISTTRAIN_STORE=str(home / "jobs.db"))
    # The hung run waits out its --hang-timeout while the finished and the failed run are made: they start once
    # both its ranks are past their last collective (the branch), so nothing but the hang itself is timed meanwhile.
    with open(work / "hang.stderr", "w+") as hang_err:
        hang = subprocess.Popen([sys.executable, "-m", "disttrain", "run", "-n", "2", "--hang-timeout", "5",
                                 str(SCRIPTS / "plain_hang.py"), "op"], stdout=subprocess.PIPE, stderr=hang_err,
                                text=True, env=env)
        try:
            at_branch = 0
            while at_branch < 2:
                line = hang.stdout.readline()
                assert line, f"the hung run ended before its ranks reached the branch: {_tail(hang_err)}"
                at_branch += "at the branch" in line
            done = disttrain("run", "-n", "2", "--checkpoint-dir", str(work / "ckpt"),
                             str(SCRIPTS / "elastic_train.py"), "--out", str(work / "out"), "--samples", "48",
                             "--epochs", "1", "--every", "4", "--pause", "0.1", timeout=240, env=env)
            assert done.returncode == 0, done.stderr[-3000:]
            done = disttrain("run", "-n", "2", str(SCRIPTS / "fail_rank1.py"), timeout=240, env=env)
            assert done.returncode == 3, done.stderr[-3000:]
            hang.communicate(timeout=240)
        finally:
            if hang.poll() is None:
                kill_tree(hang.pid)
                hang.communicate()
        assert hang.returncode == 124, _tail(hang_err)
    write(work / "loss.py", TUNE_SCRIPT)
    done = disttrain("tune", "run", "loss.py", "--param", "lr=0.01:1:log", "--param", "layers=1:4", "--param",
                     "opt=adam,sgd", "--set", "epochs=2", "--objective", "loss", "--minimize", "--trials", "3",
                     "--parallel", "3", "--seed", "7", "--name", "uitune", timeout=400, cwd=work, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    _each_trial_gave_its_loss(home, done.stdout)
    elastic_run(home / "runs", "20261128-041907-elastic_train-6ed6", live=True)  # its times moved to now: first
    return home


def _each_trial_gave_its_loss(home: Path, said: str) -> None:
    """Every trial Completed with a loss point; else what the tuning job said and each short trial's
    record and log (the tune itself succeeds once one trial gave a value)."""
    with JobStore(home / "jobs.db") as store:
        trials = [(r, store.metric_series(r.id)) for r in store.list()]
    short = [(r, series) for r, series in trials if r.state is not JobState.COMPLETED or "loss" not in series]
    for record, series in short:
        log = record.logs / "job.log"
        said += (f"\n--- {record.name}: {record.state}, failure {record.failure!r}, series {sorted(series)}\n"
                 + (log.read_text(errors="replace")[-3000:] if log.exists() else f"(no {log})"))
    assert not short, said


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-3000:]


@pytest.fixture(scope="module")
def server(home: Path):
    """uvicorn serving the app on a free loopback port, in a thread of this process."""
    import uvicorn

    app = Watched(create_app(Settings(runs_dir=home / "runs", store=home / "jobs.db", refresh_s=1.0)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield app, f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv.should_exit = True
    thread.join(timeout=20)
    sock.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ui-screenshots")
    print(f"\nscreenshots of disttrain ui: {folder}", file=sys.stderr)
    return folder


def browse(url: str, work: Path, *args: str, height: int = 1000, budget_ms: int = 4000) -> str:
    """The page's DOM once its scripts ran for ``budget_ms`` of the browser's virtual time."""
    work.mkdir(exist_ok=True)
    # --no-sandbox: the suite runs as root in CI, where Chromium's sandbox refuses to start
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--no-first-run", f"--user-data-dir={work / 'profile'}", f"--window-size=1280,{height}",
                        f"--virtual-time-budget={budget_ms}", *args, url],
                       capture_output=True, text=True, timeout=120, cwd=work, env={**os.environ, "HOME": str(work)})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def dom(url: str, work: Path, **kw) -> str:
    return browse(url, work, "--dump-dom", **kw)


def screenshot(app: Watched, url: str, work: Path, shot: Path, **kw) -> None:
    app.probe = False  # the page as a person sees it
    try:
        browse(url, work, f"--screenshot={shot}", **kw)
    finally:
        app.probe = True
    assert shot.exists() and shot.stat().st_size > 10_000


def text_of(html: str, element_id: str) -> str:
    part = html.split(f'id="{element_id}"', 1)[1].split(">", 1)[1]
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", part)).strip()


def run_named(home: Path, part: str) -> str:
    return next(p.name for p in (home / "runs").iterdir() if part in p.name)


def test_the_runs_list_shows_every_run_with_its_status(home, server, shots, tmp_path):
    app, base = server
    page = dom(f"{base}/runs", tmp_path)
    listed = rows(page, "runs")
    status = {name: text.split()[1] for name, text in listed.items()}
    assert status[run_named(home, "elastic_train-6ed6")] == "Running"
    assert status[run_named(home, "plain_hang")] == "Hung"
    assert sorted(status.values()).count("Completed") >= 1
    assert "cause: a mismatch in collective #6" in listed[run_named(home, "plain_hang")]
    screenshot(app, f"{base}/runs", tmp_path, shots / "runs.png", height=700)


def test_a_finished_runs_page_shows_its_checkpoints_steps_and_logs(home, server, shots, tmp_path):
    app, base = server
    run = next(p.name for p in (home / "runs").iterdir() if "elastic_train" in p.name and "6ed6" not in p.name
               and json.loads((p / "plan.json").read_text())["world_size"] == 2)
    page = dom(f"{base}/runs/{run}", tmp_path)
    assert 'id="status">Completed<' in page
    assert re.findall(r'data-rank="(\d)">[\d.]+ steps/s \(mean\)', page) == ["0", "1"]
    table = page.split('id="checkpoints"', 1)[1].split("</table>", 1)[0]
    assert "ok: " in table and "sizes as the marker lists them" in table and "step_000000" in table
    link = re.search(r'href="(/runs/[^"]+/verify/\d+)"', table)[1]
    assert dom(base + link, tmp_path).count("ok: step ") == 1  # every file hashed against its marker
    assert "goodput" in text_of(page, "goodput") and 'href="/runs/' + run + '/log/attempt_0/rank0.stdout"' in page
    screenshot(app, f"{base}/runs/{run}", tmp_path, shots / "run-finished.png", height=1500)


def test_a_failed_runs_page_leads_with_the_rank_that_failed_first_and_its_traceback(home, server, tmp_path):
    app, base = server
    run = run_named(home, "fail_rank1")
    listed = rows(dom(f"{base}/runs?status=Failed", tmp_path), "runs")
    assert list(listed) == [run] and " 3 disttrain: rank 1 on vm exited with code 3 (pid " in listed[run]
    page = dom(f"{base}/runs/{run}", tmp_path)
    failure = text_of(page, "failure")
    assert page.index('id="failure"') < page.index('id="facts"') and 'id="status">Failed<' in page
    assert failure.startswith("Root cause disttrain: rank 1 on vm exited with code 3")
    assert "ValueError: rank one cannot go on: bad shard 17" in failure


def test_a_hung_runs_page_leads_with_the_verdicts_ranks_and_collectives(home, server, shots, tmp_path):
    app, base = server
    run = run_named(home, "plain_hang")
    page = dom(f"{base}/runs/{run}", tmp_path)
    verdict = text_of(page, "verdict")
    assert page.index('id="verdict"') < page.index('id="facts"')
    assert "rank 0 (" in verdict and "in #6 all_reduce [4] Float" in verdict
    assert "rank 1 (" in verdict and "in #6 all_gather [4] Float -&gt; [2, 4]" in verdict
    assert 'id="status">Hung<' in page
    screenshot(app, f"{base}/runs/{run}", tmp_path, shots / "run-hung.png", height=900)


def test_a_live_elastic_run_shows_the_lost_host_and_updates_without_a_reload(home, server, shots, tmp_path):
    app, base = server
    run = "20261128-041907-elastic_train-6ed6"
    run_dir = home / "runs" / run
    import httpx

    for i in range(4):  # the ranks beat while the page is open: each poll samples their steps
        t = time.time() - 8 + 2 * i
        for node, rank in ((0, 0), (1, 1)):
            beat = run_dir / "heartbeat" / f"node{node}" / f"rank{rank}"
            beat.write_text(json.dumps({"pid": 1, "rank": rank, "steps": 30 + i * (8 + rank)}))
            os.utime(beat, (t, t))
        httpx.get(f"{base}/runs/{run}/live", timeout=30)
    screenshot(app, f"{base}/runs/{run}", tmp_path, shots / "run-elastic-live.png", height=1300, budget_ms=500)
    page = dom(f"{base}/runs/{run}", tmp_path, budget_ms=500)
    timeline = page.split('id="timeline"', 1)[1].split("</svg>", 1)[0]
    assert re.findall(r'class="change change-(\w+)" data-host="([^"]+)"', timeline) == [("left", "10.77.84.3")]
    assert 'id="status">Running<' in page and re.search(r'data-rank="1">rank 1: [\d.]+/s<', page)

    ended = threading.Event()

    def the_run_ends(path: str) -> None:  # on the page's first update: the run's end record appears
        if path == f"/runs/{run}/live" and not ended.is_set():
            with open(run_dir / goodput.RECORD, "a") as fh:
                fh.write(json.dumps({"kind": "end", "t": time.time(), "exit_code": 0, "hung": False}) + "\n")
            ended.set()

    app.seen.clear()
    app.on_request = the_run_ends
    try:
        page = dom(f"{base}/runs/{run}", tmp_path, budget_ms=5000)
    finally:
        app.on_request = None
    assert ended.is_set() and 'id="status">Completed<' in page and 'data-live="0"' in page
    assert app.seen.count(f"/runs/{run}") == 1 and app.seen.count(f"/runs/{run}/live") >= 1  # never reloaded
    assert PROBED.search(page), "the page's load probe ran once, in the first load"


def test_the_jobs_list_groups_the_trials_under_their_tuning_job_with_the_best_value(home, server, shots, tmp_path):
    app, base = server
    with JobStore(home / "jobs.db") as store:
        values = {r.name: store.metric_series(r.id)["loss"][-1][1] for r in store.list()}
    best = min(values, key=values.get)
    page = dom(f"{base}/jobs", tmp_path)
    group = page.split('data-tuning="uitune"', 1)[1].split("</tr>", 1)[0]
    assert f"best {values[best]:.6g}" in group and f'href="/jobs/{best}"' in group
    listed = rows(page, "jobs")
    assert sorted(listed) == sorted(values) and all(" Completed " in text for text in listed.values())
    assert re.search(r" algo-1 \(\S+\) 1 0 ", listed[best]), listed[best]  # instance (host), world size, exit
    trials = re.findall(r'<tr class="trial( best)?" data-job="([^"]+)"', page)
    assert sorted(name for _, name in trials) == sorted(values) and [n for b, n in trials if b] == [best]
    screenshot(app, f"{base}/jobs", tmp_path, shots / "jobs.png", height=500)
    job = dom(f"{base}/jobs/{best}", tmp_path)
    assert 'id="job-status">Completed<' in job and "Its run" in job
    screenshot(app, f"{base}/jobs/{best}", tmp_path, shots / "job.png", height=1100)


def test_a_thousand_runs_list_opens_in_the_browser(tmp_path, shots):
    """The figure (how long the page took to open) is printed for docs/measured.md; never asserted."""
    import uvicorn

    thousand_runs(tmp_path)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = Watched(create_app(Settings(runs_dir=tmp_path / "runs", store=tmp_path / "jobs.db")))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not uv.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # The first open after the start (templates compiled, every folder read), then a later one (the
        # ended runs' rows kept: one stat each)
        first, later = (json.loads(PROBED.search(dom(f"{base}/runs", tmp_path / name, budget_ms=1000))[1])
                        for name in ("first", "later"))
    finally:
        uv.should_exit = True
        thread.join(timeout=20)
        sock.close()
    assert first["rows"] == later["rows"] == 1000
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    print(f"\nthe list of 1,000 runs opened in Chromium in {first['open_ms']:.0f} ms the first time, "
          f"{later['open_ms']:.0f} ms later (load {' '.join(load)})", file=sys.stderr)
    shutil.rmtree(tmp_path / "runs")
