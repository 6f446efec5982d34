"""``python -m disttrain.jobs.smdriver --command CMD | --script ENTRY.sh [ARGS...]``: in one instance.

What SDK v3's ``sm_train.sh`` does around ``SourceCode(command=...)`` (and its basic driver
around a ``.sh`` entry script): the command runs through bash in the code folder with the
instance's ``SM_*`` variables, and when it fails ``/opt/ml/output/failure`` gets a line (unless
the command wrote one itself) and the instance exits with the command's status.

A SageMaker container has no torchrun variables of its own: those the instance's agent gives
its one worker (``RANK``, ``MASTER_PORT``, ...) are removed, so a ``torchrun`` inside the
command starts from the same environment as on SageMaker, and ``python``/``torchrun`` are this
interpreter's (its folder first on ``PATH``, as the image's Python is there). bash replaces this
process: the agent's signals reach the command's whole process group.
"""

from __future__ import annotations

import os
import shlex
import sys

# What torch's elastic agent sets for each worker; a command starts its own launcher.
AGENT_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
AGENT_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")

SCRIPT = r"""
set -e
on_exit() {
    status=$?
    if [ "$status" -ne 0 ] && [ ! -s "$SM_OUTPUT_FAILURE" ]; then
        printf 'Training Execution failed (exit code %s): see `disttrain jobs logs %s`\n' \
            "$status" "$TRAINING_JOB_NAME" >> "$SM_OUTPUT_FAILURE"
    fi
}
trap on_exit EXIT
cd "$SM_SOURCE_DIR"
echo "Executing command: $1"
eval "$1"
"""


def command_line(argv: list[str]) -> str:
    """The shell command: ``--command CMD`` (its words joined by single spaces, as ModelTrainer
    does), or ``--script ENTRY ARGS...`` (made executable and run with its arguments quoted)."""
    if len(argv) == 2 and argv[0] == "--command":
        return " ".join(argv[1].split())
    if len(argv) >= 2 and argv[0] == "--script":
        entry, args = argv[1], argv[2:]
        return f"chmod +x {shlex.quote(entry)} && ./{shlex.quote(entry)} {shlex.join(args)}".rstrip()
    raise SystemExit("usage: python -m disttrain.jobs.smdriver --command CMD | --script ENTRY.sh [ARGS...]")


def container_env(environ: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in AGENT_VARS and not k.startswith(AGENT_PREFIXES)}
    env["PATH"] = os.pathsep.join(filter(None, (os.path.dirname(sys.executable), environ.get("PATH"))))
    return env


def main(argv: list[str] | None = None) -> None:
    line = command_line(list(sys.argv[1:] if argv is None else argv))
    sys.stdout.flush()
    os.execve("/bin/bash", ["bash", "-c", SCRIPT, "sm_train", line], container_env(dict(os.environ)))


if __name__ == "__main__":
    main()
