"""The web app of ``disttrain ui``: Starlette routes rendering Jinja2 templates, served by uvicorn.

Pages are rendered on the server from :mod:`.runs_list`, :mod:`.run_page` and :mod:`.job_view`; a live
run's page asks for its ``/live`` part every few seconds and puts it in place (a small script, no
library, nothing from the network). Beyond loopback every request must carry the token the command printed (in the
URL once; a cookie then keeps it for the pages it links to).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from . import charts
from .job_view import JobRow, job_row, read_job, read_jobs, spec_items, tuning_groups
from .run_page import Rates, checkpoint_dir, log_path, read_view, verify
from .runs_list import RowCache, list_runs, matches

COOKIE = "disttrain_ui_token"
RUN_STATUSES = ("Running", "Completed", "Failed", "Hung", "Stopped", "Unknown")
JOB_STATUSES = ("Pending", "Staging", "Running", "Uploading", "Completed", "Failed", "Stopped")


@dataclass(frozen=True, kw_only=True)
class Settings:
    runs_dir: Path  # $DISTTRAIN_HOME/runs
    store: Path  # the job store (jobs.db); the tuning jobs' study beside it
    refresh_s: float = 2.0  # how often a live page asks for its update
    token: str | None = None  # required on every request when set
    warm: bool = False  # read the run folders once at the start, in a thread (the command does)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def when(t: float | None) -> str:
    """A time as the page shows it; "-" for none, or for what another version wrote that is not a time."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if _is_number(t) and t > 0 else "-"


def duration(s: float | None) -> str:
    if not _is_number(s):
        return "-"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def size(n: int | None) -> str:
    if not _is_number(n):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def templates() -> Environment:
    env = Environment(loader=PackageLoader("disttrain.ui", "templates"), autoescape=select_autoescape(["html"]))
    env.filters.update(when=when, duration=duration, size=size)
    env.globals.update(rates_plot=charts.rates_plot, timeline=charts.timeline, goodput_bar=charts.goodput_bar)
    return env


class TokenGate:
    """Refuses every request without the token (query ``token=`` or the cookie it sets)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        given = request.query_params.get("token")
        if given is not None and secrets.compare_digest(given, self.token):
            async def with_cookie(message) -> None:
                if message["type"] == "http.response.start":
                    cookie = f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
                    message["headers"] = [*message.get("headers", []), (b"set-cookie", cookie.encode())]
                await send(message)

            await self.app(scope, receive, with_cookie)
            return
        if secrets.compare_digest(request.cookies.get(COOKIE, ""), self.token):
            await self.app(scope, receive, send)
            return
        response = PlainTextResponse("disttrain ui: this page needs the token that `disttrain ui` printed: open the "
                                     "URL it printed (…/?token=…)\n", status_code=403)
        await response(scope, receive, send)


def create_app(settings: Settings) -> ASGIApp:
    env = templates()
    rates, rows_seen = Rates(), RowCache()
    if settings.warm:  # the list's first open then finds the ended runs read already
        threading.Thread(target=list_runs, args=(settings.runs_dir, rows_seen), name="disttrain-ui-warm",
                         daemon=True).start()

    def page(template: str, /, **context) -> HTMLResponse:
        html = env.get_template(template).render(refresh_s=settings.refresh_s, now=time.time(), **context)
        return HTMLResponse(html)

    def run_dir(run_id: str) -> Path | None:
        if not run_id or run_id.startswith(".") or "/" in run_id or "\\" in run_id:
            return None
        path = settings.runs_dir / run_id
        return path if path.is_dir() else None

    async def home(request: Request) -> Response:
        return RedirectResponse("/runs", status_code=307)

    async def runs(request: Request) -> Response:
        name, status = request.query_params.get("name") or None, request.query_params.get("status") or None
        rows = [r for r in list_runs(settings.runs_dir, rows_seen)
                if matches(f"{r.id} {r.name}", r.status, name=name, status=status)]
        return page("runs.html", rows=rows, name=name or "", status=status or "", statuses=RUN_STATUSES,
                    runs_dir=settings.runs_dir)

    def missing(what: str) -> HTMLResponse:
        return HTMLResponse(env.get_template("missing.html").render(what=what), status_code=404)

    async def run(request: Request) -> Response:
        folder = run_dir(request.path_params["run"])
        if folder is None:
            return missing(f"no run {request.path_params['run']!r} in {settings.runs_dir}")
        return page("run.html", view=read_view(folder, rates), live_src=f"/runs/{folder.name}/live",
                    base=f"/runs/{folder.name}")

    async def run_live(request: Request) -> Response:
        folder = run_dir(request.path_params["run"])
        if folder is None:
            return missing(f"no run {request.path_params['run']!r}")
        return page("run_live.html", view=read_view(folder, rates), base=f"/runs/{folder.name}")

    def log_response(folder: Path | None, rel: str) -> Response:
        path = log_path(folder, rel) if folder is not None else None
        if path is None:
            return PlainTextResponse(f"no log {rel!r} in this run\n", status_code=404)
        return PlainTextResponse(path.read_text(errors="replace"))

    async def run_log(request: Request) -> Response:
        return log_response(run_dir(request.path_params["run"]), request.path_params["path"])

    def verify_response(folder: Path | None, step: int) -> Response:
        from .runs_list import json_of

        found = verify(checkpoint_dir(json_of(folder / "plan.json")), step) if folder is not None else None
        if found is None:
            return PlainTextResponse(f"no complete checkpoint at step {step} in this run's folder\n", status_code=404)
        ok, said = found
        return PlainTextResponse(("ok: " if ok else "BAD: ") + said + "\n")

    async def run_verify(request: Request) -> Response:
        return verify_response(run_dir(request.path_params["run"]), request.path_params["step"])

    def job_rows(status: str | None, name: str | None) -> tuple[list, list[JobRow]]:
        rows = {r.name: job_row(r) for r in read_jobs(settings.store)}
        groups = tuning_groups(settings.store, rows)
        groups = [g for g in groups if matches(g.name, g.status, name=name, status=status)
                  or any(matches(t.name, t.status, name=name, status=status) for t in g.trials)]
        return groups, [r for r in rows.values() if matches(r.name, r.status, name=name, status=status)]

    async def jobs(request: Request) -> Response:
        name, status = request.query_params.get("name") or None, request.query_params.get("status") or None
        groups, rows = job_rows(status, name)
        return page("jobs.html", groups=groups, rows=rows, name=name or "", status=status or "",
                    statuses=JOB_STATUSES, store=settings.store)

    def job_context(name: str):
        from ..errors import UsageError

        if not settings.store.is_file():
            return None  # a view makes no store
        try:
            record, metrics = read_job(settings.store, name)
        except UsageError:
            return None
        folder = Path(record.log_dir) if record.log_dir and Path(record.log_dir).is_dir() else None
        view = read_view(folder, rates) if folder is not None else None
        return dict(record=record, row=job_row(record), metrics=metrics, spec=spec_items(record), view=view,
                    lead_shown=True,
                    live_src=f"/jobs/{record.name}/live", base=f"/jobs/{record.name}")

    async def job(request: Request) -> Response:
        context = job_context(request.path_params["job"])
        if context is None:
            return missing(f"no job {request.path_params['job']!r} in {settings.store}")
        return page("job.html", **context)

    async def job_live(request: Request) -> Response:
        context = job_context(request.path_params["job"])
        if context is None or context["view"] is None:
            return missing(f"no run folder for job {request.path_params['job']!r}")
        return page("run_live.html", **context)

    def job_folder(name: str) -> Path | None:
        context = job_context(name)
        return Path(context["record"].log_dir) if context and context["view"] is not None else None

    async def job_log(request: Request) -> Response:
        return log_response(job_folder(request.path_params["job"]), request.path_params["path"])

    async def job_verify(request: Request) -> Response:
        return verify_response(job_folder(request.path_params["job"]), request.path_params["step"])

    app: ASGIApp = Starlette(routes=[
        Route("/", home),
        Route("/runs", runs),
        Route("/runs/{run}", run),
        Route("/runs/{run}/live", run_live),
        Route("/runs/{run}/log/{path:path}", run_log),
        Route("/runs/{run}/verify/{step:int}", run_verify),
        Route("/jobs", jobs),
        Route("/jobs/{job}", job),
        Route("/jobs/{job}/live", job_live),
        Route("/jobs/{job}/log/{path:path}", job_log),
        Route("/jobs/{job}/verify/{step:int}", job_verify),
    ])
    if settings.token:
        app = TokenGate(app, settings.token)
    return app
