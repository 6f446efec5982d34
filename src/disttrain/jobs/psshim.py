"""``distribution={'parameter_server': ...}``: one instance's two TensorFlow tasks.

As SageMaker's TensorFlow toolkit does: each instance runs the script as a ps task in the
background and as the master (instance 0) or a worker in the foreground, each with its own
``TF_CONFIG``; when the foreground task ends, the ps task is stopped and the foreground's
exit code is the instance's. Standard library only: it runs before every such task.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

PS_GRACE_S = 10


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit("usage: python -m disttrain.jobs.psshim SCRIPT [ARGS...]")
    command = [sys.executable, "-u", *argv]
    ps = subprocess.Popen(command, env={**os.environ, "TF_CONFIG": os.environ["DISTTRAIN_PS_TASK_TF_CONFIG"]})
    main_task = subprocess.Popen(command, env={**os.environ, "TF_CONFIG": os.environ["DISTTRAIN_PS_TF_CONFIG"]})

    def forward(signum, _frame) -> None:  # the agent stops us: stop both tasks
        for proc in (main_task, ps):
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = main_task.wait()
    if ps.poll() is None:
        ps.terminate()
        try:
            ps.wait(timeout=PS_GRACE_S)
        except subprocess.TimeoutExpired:
            ps.kill()
            ps.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
