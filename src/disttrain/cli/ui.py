"""``disttrain ui``: serve the web view of every run and job (loopback by default)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import socket
import sys

from ..errors import UsageError
from .job import add_store_arg

DEFAULT_PORT = 8470


def add_parser(sub: argparse._SubParsersAction) -> None:
    ui = sub.add_parser("ui", help="a web page of every run and job, live while they run",
                        description="Serve a web page of the runs ($DISTTRAIN_HOME/runs) and the jobs (the job "
                        "store, the tuning jobs): status, hosts, root cause, each run's steps/s, membership, "
                        "goodput, checkpoints and logs, updating while it runs. Loopback only unless --host says "
                        "otherwise; then the printed URL holds a token every request needs.")
    ui.add_argument("--host", default="127.0.0.1",
                    help="the address to listen on (default 127.0.0.1; 0.0.0.0: every interface, with a token)")
    ui.add_argument("--port", type=int, default=DEFAULT_PORT,
                    help=f"the port (default {DEFAULT_PORT}; 0: any free port)")
    ui.add_argument("--home", default=None, metavar="DIR",
                    help="the disttrain home whose runs/ to show (default: $DISTTRAIN_HOME, else ~/.disttrain)")
    add_store_arg(ui)
    ui.add_argument("--refresh", type=float, default=2.0, metavar="SECONDS",
                    help="how often a live run's page updates itself (default 2)")
    ui.set_defaults(handler=handle)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made here so that a taken port or an unknown address is one line, and port 0
    names the port it got."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise UsageError(f"--host {host!r} is not an address of this machine ({err.strerror}): give an IP "
                         "address or a name that resolves, e.g. 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror}: pass another --port (0: any free port)"
                         + (" or --host" if err.errno != 98 else "")) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def handle(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..home import disttrain_home, plain_path
    from ..store.db import STORE_ENV

    if not 0 < args.refresh < 86400:
        raise UsageError(f"--refresh {args.refresh:g} must be a number of seconds above 0, e.g. 2")
    try:
        import uvicorn

        from ..ui.server import Settings, create_app
    except ImportError as err:
        raise UsageError(f"disttrain ui needs its web stack ({err.name} is missing): "
                         "pip install 'disttrain[ui]'") from None
    home = Path(plain_path(args.home, "--home", fix="give a plain folder path")) if args.home else disttrain_home()
    # --store, else $DISTTRAIN_STORE, else the home's jobs.db (the home given with --home, or the default's)
    store = Path(args.store or os.environ.get(STORE_ENV) or home / "jobs.db")
    token = None if is_loopback(args.host) else secrets.token_urlsafe(18)
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    app = create_app(Settings(runs_dir=home / "runs", store=store, refresh_s=args.refresh, token=token, warm=True))
    print(f"disttrain ui: {url} (runs in {home / 'runs'}, jobs in {store}; Ctrl-C to stop)", flush=True)
    if token:
        print("disttrain ui: listening beyond loopback: every request needs the token in that URL", file=sys.stderr,
              flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    server.run(sockets=[sock])
    return 0
