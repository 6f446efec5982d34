"""``distribution={'parameter_server': ...}``: one instance's two TensorFlow tasks.

As SageMaker's TensorFlow toolkit does: each instance runs the script as a ps task in the
background and as the master (instance 0) or a worker in the foreground, each with its own
``TF_CONFIG``; when the foreground task ends, the ps task is stopped and the foreground's
exit code is the instance's. Standard library only: it runs before every such task.

A ps task is stopped only once it serves on its address (TensorFlow's server listens there
until the job ends) or has ended on its own: a ps task still starting when a short foreground
task ended (imports on a loaded machine) would be stopped before it wrote anything.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

PS_GRACE_S = 10
PS_SERVE_S = 60  # how long a ps task may take to serve once the foreground task ended


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit("usage: python -m disttrain.jobs.psshim SCRIPT [ARGS...]")
    command = [sys.executable, "-u", *argv]
    ps_config = os.environ["DISTTRAIN_PS_TASK_TF_CONFIG"]
    ps = subprocess.Popen(command, env={**os.environ, "TF_CONFIG": ps_config})
    main_task = subprocess.Popen(command, env={**os.environ, "TF_CONFIG": os.environ["DISTTRAIN_PS_TF_CONFIG"]})

    def forward(signum, _frame) -> None:  # the agent stops us: stop both tasks
        for proc in (main_task, ps):
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = main_task.wait()
    if ps.poll() is None:
        _wait_serving(ps, _ps_address(ps_config))
    if ps.poll() is None:
        ps.terminate()
        try:
            ps.wait(timeout=PS_GRACE_S)
        except subprocess.TimeoutExpired:
            ps.kill()
            ps.wait()
    return code if code >= 0 else 128 - code


def _ps_address(tf_config: str) -> tuple[str, int] | None:
    try:
        config = json.loads(tf_config)
        host, _, port = config["cluster"]["ps"][config["task"]["index"]].rpartition(":")
        return host.strip("[]"), int(port)
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _wait_serving(ps: subprocess.Popen, address: tuple[str, int] | None) -> None:
    deadline = time.monotonic() + PS_SERVE_S
    while address is not None and ps.poll() is None:
        try:
            socket.create_connection(address, timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                print(f"disttrain: the ps task did not serve on {address[0]}:{address[1]} within {PS_SERVE_S} s "
                      "of the end of the job's task; stopping it", file=sys.stderr, flush=True)
                return
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
