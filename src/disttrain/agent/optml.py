"""A private ``/opt/ml`` per job instance: scripts that hard-code SageMaker's paths run unchanged.

The plan names, per node, the folder its processes must see at ``/opt/ml`` (a job instance's
folder, :attr:`~disttrain.plan.launch.NodePlan.opt_ml`). Whatever starts those processes on
the node's own machine -- the node's agent for its workers (local, ssh and Slurm launchers
alike), ``mpirun`` for its ranks -- asks :func:`instance_prefix` there, so the tool is checked
where the processes run, and puts the returned argv before each command. Each process then
starts in a mount namespace of its own in which ``/opt/ml`` is that folder: two instances on
one machine never collide, and the machine's own ``/opt/ml`` is never written. Where it does
not exist, ``/opt`` is covered (inside the namespace only) by a small tmpfs holding the
machine's ``/opt`` entries bound back in, plus ``ml``.

- as root: ``unshare --mount --propagation private`` runs this file, which mounts and then
  ``exec``s the command (one pid throughout, so the agent's signals reach the script);
- other users: bubblewrap (``bwrap``, Debian's ``bubblewrap``), which makes the user namespace
  needed to mount without privileges.

Inside the namespace the instance's SageMaker host names resolve too: where the job wrote a
hosts file beside the instance folder (:func:`hosts_file`: ``ADDRESS algo-K`` lines), the
namespace's ``/etc/hosts`` is the machine's own plus those lines, so ``algo-1`` (SDK v3's
``SM_MASTER_ADDR``, ``torchrun --master_addr algo-1``) reaches the first instance. The merged
file is made on the machine the processes run on (:func:`etc_hosts`), next to the hosts file.

Run as a file (``python -S -E optml.py INSTANCE_DIR [--etc-hosts FILE] -- CMD...``) before every
worker: standard library only, no package import at start-up.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
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


def hosts_file(instance_dir: str) -> str:
    """Where a job puts the host names its instances resolve (``ADDRESS NAME`` lines): beside the
    instance's folder, so that it is not under /opt/ml."""
    return os.path.normpath(instance_dir) + ".hosts"


def etc_hosts(instance_dir: str) -> str | None:
    """This machine's ``/etc/hosts`` plus the job's host names, written beside the instance folder
    (whole or not at all); None when the job wrote no hosts file."""
    try:
        with open(hosts_file(instance_dir)) as fh:
            names = fh.read()
    except FileNotFoundError:
        return None
    try:
        with open("/etc/hosts") as fh:
            machine = fh.read()
    except OSError:
        machine = ""
    merged = os.path.normpath(instance_dir) + ".etc_hosts"
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(merged), prefix=".etc_hosts.")
    with os.fdopen(fd, "w") as fh:
        fh.write(machine.rstrip("\n") + "\n# the job's instances (disttrain)\n" + names)
    os.chmod(tmp, 0o644)
    os.replace(tmp, merged)
    return merged


def prefix(tool: str, instance_dir: str) -> list[str]:
    """The argv that runs a command with ``instance_dir`` at /opt/ml (the command follows)."""
    hosts = etc_hosts(instance_dir)
    if tool == "unshare":
        return ["unshare", "--mount", "--propagation", "private", "--",
                sys.executable, "-S", "-E", os.path.abspath(__file__), instance_dir,
                *(["--etc-hosts", hosts] if hosts else []), "--"]
    # --die-with-parent: bwrap forks the command, and the agent stops a worker by signalling bwrap.
    argv = ["bwrap", "--dev-bind", "/", "/", "--die-with-parent"]
    if not os.path.isdir(OPT_ML):
        argv += ["--tmpfs", OPT]  # bwrap takes bind sources from the real root, so /opt's entries come back
        for entry in sorted(os.scandir(OPT), key=lambda e: e.name):
            target = os.path.join(OPT, entry.name)
            if entry.is_symlink():
                argv += ["--symlink", os.readlink(entry.path), target]
            else:
                argv += ["--dev-bind", entry.path, target]
    if hosts:
        argv += ["--ro-bind", hosts, "/etc/hosts"]
    return [*argv, "--bind", instance_dir, OPT_ML, "--"]


def available(*, required: bool, where: str, say) -> bool:
    """Whether this machine (``where``, for messages) can make a private /opt/ml. When it cannot:
    one line through ``say`` (scripts reading SM_* still run), or, ``required``
    (``private_opt_ml: required``), a UsageError naming the machine and the fix."""
    tool, why = namespace_tool()
    if tool:
        return True
    if required:
        from ..errors import UsageError  # here, not at the top: this file also runs bare, before workers

        raise UsageError(f"private_opt_ml: required, but {where} cannot make a private /opt/ml ({why}); {FIX} "
                         "(or set private_opt_ml: auto and read the SM_* variables)")
    say(f"disttrain: no private /opt/ml on {where} ({why}): scripts reading SM_* run, literal /opt/ml paths "
        f"do not; to have them: {FIX}")
    return False


def instance_prefix(instance_dir: str, *, required: bool, host: str, say) -> list[str]:
    """On the machine the instance's processes run on: the prefix that gives them ``instance_dir``
    at /opt/ml, or [] (see :func:`available`)."""
    if not available(required=required, where=host, say=say):
        return []
    return prefix(namespace_tool()[0], instance_dir)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def mount_private_opt_ml(instance_dir: str) -> None:
    """Inside a fresh mount namespace (as root): make /opt/ml show ``instance_dir``."""
    if os.path.isdir(OPT_ML):
        _mount("--bind", instance_dir, OPT_ML)
        return
    # The new /opt is built on a mount point of our own, then moved over /opt. The folder is
    # only a mount point: once the tmpfs moved away it is empty, and removed.
    stage = tempfile.mkdtemp(prefix="disttrain-opt-")
    try:
        _mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", stage)
        for entry in os.scandir(OPT):
            target = os.path.join(stage, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
            elif entry.is_dir():
                os.mkdir(target)
                _mount("--rbind", entry.path, target)
            else:
                open(target, "w").close()
                _mount("--bind", entry.path, target)
        os.mkdir(os.path.join(stage, "ml"))
        _mount("--bind", instance_dir, os.path.join(stage, "ml"))
        _mount("--move", stage, OPT)
    finally:
        try:
            os.rmdir(stage)
        except OSError:
            pass


def main(argv: Sequence[str] | None = None) -> None:
    """``python optml.py INSTANCE_DIR [--etc-hosts FILE] -- COMMAND...`` (inside unshare)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    hosts = None
    if len(argv) > 2 and argv[1] == "--etc-hosts":
        hosts = argv[2]
        argv = [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python optml.py INSTANCE_DIR [--etc-hosts FILE] -- COMMAND...")
    try:
        mount_private_opt_ml(argv[0])
        if hosts:  # the instance's host names, in this namespace only
            _mount("--bind", hosts, "/etc/hosts")
    except (OSError, subprocess.CalledProcessError) as err:
        sys.exit(f"disttrain: cannot give this instance a private /opt/ml: {err}; {FIX}")
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main()
