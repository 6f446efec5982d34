"""A private ``/opt/ml`` per instance: scripts that hard-code SageMaker's paths run unchanged.

Each instance's agent (and so every process of that instance) starts in its own mount
namespace in which ``/opt/ml`` is the instance's folder of the job directory. Two instances
on one machine never collide, and the machine's own ``/opt/ml`` is never written: where it
does not exist, ``/opt`` is covered (inside the namespace only) by a small tmpfs holding
the machine's ``/opt`` entries bound back in, plus ``ml``.

- as root: ``unshare --mount --propagation private`` starts ``python -m disttrain.jobs.optml``,
  which mounts and then ``exec``s the agent (same pid, so stopping it works as before);
- other users: bubblewrap (``bwrap``, Debian's ``bubblewrap``), which makes the user namespace
  needed to mount without privileges.

Standard library only: the helper runs before every instance's agent.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

OPT = "/opt"
OPT_ML = "/opt/ml"
FIX = ("run as root (util-linux's unshare) or install bubblewrap (apt-get install bubblewrap) and allow "
       "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)")


@functools.lru_cache(maxsize=None)
def namespace_tool() -> tuple[str | None, str]:
    """("unshare" | "bwrap" | None, why not): which way this machine can make a private /opt/ml."""
    if not os.path.isdir(OPT):
        return None, f"{OPT} does not exist on this machine"
    if os.geteuid() == 0 and shutil.which("unshare"):
        probe = ["unshare", "--mount", "--propagation", "private", "true"]
        tool = "unshare"
    elif shutil.which("bwrap"):
        probe = ["bwrap", "--dev-bind", "/", "/", "true"]
        tool = "bwrap"
    else:
        return None, "neither root with unshare nor bubblewrap is available"
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"{tool} failed: {err}"
    if done.returncode:
        return None, f"{tool} cannot make a mount namespace here: {done.stderr.strip().splitlines()[-1:] or '?'}"
    return tool, ""


def prefix(tool: str, instance_dir: str, stage_dir: str) -> list[str]:
    """The argv that runs a command with ``instance_dir`` at /opt/ml (the command follows)."""
    if tool == "unshare":
        return ["unshare", "--mount", "--propagation", "private", "--",
                sys.executable, "-m", "disttrain.jobs.optml", instance_dir, stage_dir, "--"]
    argv = ["bwrap", "--dev-bind", "/", "/"]
    if not os.path.isdir(OPT_ML):
        argv += ["--tmpfs", OPT]  # bwrap takes bind sources from the real root, so /opt's entries come back
        for entry in sorted(os.scandir(OPT), key=lambda e: e.name):
            target = os.path.join(OPT, entry.name)
            if entry.is_symlink():
                argv += ["--symlink", os.readlink(entry.path), target]
            else:
                argv += ["--dev-bind", entry.path, target]
    return [*argv, "--bind", instance_dir, OPT_ML, "--"]


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def mount_private_opt_ml(instance_dir: str, stage_dir: str) -> None:
    """Inside a fresh mount namespace (as root): make /opt/ml show ``instance_dir``."""
    if os.path.isdir(OPT_ML):
        _mount("--bind", instance_dir, OPT_ML)
        return
    os.makedirs(stage_dir, exist_ok=True)
    _mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", stage_dir)
    for entry in os.scandir(OPT):
        target = os.path.join(stage_dir, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            os.mkdir(target)
            _mount("--rbind", entry.path, target)
        else:
            open(target, "w").close()
            _mount("--bind", entry.path, target)
    os.mkdir(os.path.join(stage_dir, "ml"))
    _mount("--bind", instance_dir, os.path.join(stage_dir, "ml"))
    _mount("--move", stage_dir, OPT)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m disttrain.jobs.optml INSTANCE_DIR STAGE_DIR -- COMMAND...`` (inside unshare)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: python -m disttrain.jobs.optml INSTANCE_DIR STAGE_DIR -- COMMAND...")
    try:
        mount_private_opt_ml(argv[0], argv[1])
    except (OSError, subprocess.CalledProcessError) as err:
        sys.exit(f"disttrain: cannot give this instance a private /opt/ml: {err}; {FIX}")
    os.execvp(argv[3], argv[3:])


if __name__ == "__main__":
    main()
