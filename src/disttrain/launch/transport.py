"""How a command reaches one node: ssh to a host, srun to a node of a Slurm allocation, or a plain
process on this machine. A transport wraps the command's argv and says which failures are its own
(ssh's exit 255, srun's errors), so that a message names the transport's fault, not the command's."""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

from ..config.hosts import Host
from ..ssh import is_notice, ssh_address, ssh_argv
from ..workerenv import BOOTSTRAP_NAMES


class Transport(ABC):
    """How a command reaches one node: ``argv`` wraps it; ``name`` is the node in messages."""

    over: ClassVar[str]  # "over ssh": how the node is reached, for messages
    kept_alive: ClassVar[bool] = False  # its connection ends within seconds of the node going away

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def argv(self, command: Sequence[str]) -> list[str]:
        """The local argv that runs ``command`` on the node."""

    def own_failure(self, code: int, last: str, quiet_s: float | None = None) -> str | None:
        """What the transport itself says went wrong (not the command), if that exit was its own;
        ``quiet_s``: how long the agent had been silent when it ended (None: unknown)."""
        return None

    def answers(self, timeout_s: float) -> bool | None:
        """Whether the node takes a TCP connection within ``timeout_s`` (its machine and network are
        up); None: not known this way."""
        return None


KILLED_QUIET_S = 2.0  # an elastic job's ssh gives up on a connection after 3 s without an answer


class SshTransport(Transport):
    over = "over ssh"
    kept_alive = True  # ServerAliveInterval/CountMax: see launch/ssh.py's ELASTIC_OPTIONS

    def __init__(self, host: Host, *, options: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        super().__init__(host.name)
        self.host, self.options, self.env = host, tuple(options), env
        self._address: tuple[str, int] | bool | None = None  # where its sshd listens; False: not known

    def argv(self, command: Sequence[str]) -> list[str]:
        return ssh_argv(self.host, command, options=self.options, env=self.env)

    def answers(self, timeout_s: float) -> bool | None:
        """Its sshd's port, as ssh resolves it, takes a connection. None through a jump host or a
        proxy command (the port is not the host's), or when ssh cannot say where it connects."""
        if self._address is None:
            self._address = ssh_address(self.host, self.options) or False
        if not self._address:
            return None
        try:
            socket.create_connection(self._address, timeout=timeout_s).close()
        except ConnectionRefusedError:  # its kernel answered: the machine is up
            return True
        except OSError:  # no answer in time, no route to it
            return False
        return True

    def own_failure(self, code: int, last: str, quiet_s: float | None = None) -> str | None:
        if code != 255:
            return None
        # ssh's own last words, unless it had none (LogLevel=ERROR hides "Timeout, server not
        # responding"): then the last line is the agent's or a worker's, which would mislead.
        ours = last.strip() and not last.lstrip().startswith(("[", "disttrain")) and not is_notice(last)
        if ours:
            return f"ssh failed: {last.strip()}"
        # A lost connection ends ssh only after its keep-alives went unanswered (seconds of silence
        # from an agent that speaks each second); an agent killed by a signal (ssh exits 255 for a
        # remote signal too) ends it at once, its last word a moment before.
        if quiet_s is not None and quiet_s < KILLED_QUIET_S:
            return "its agent was killed by a signal: ssh exit 255 with its connection up"
        return "ssh failed: the connection was lost (exit 255)"


class SrunTransport(Transport):
    """One task on one node of the allocation this process runs in, with that node's CPUs.

    srun exports the bootstrap names only (and Slurm's own SLURM_*), not the launching shell:
    the environment rule is applied by the plan, as for every launcher."""

    over = "through srun"

    def __init__(self, node: str, *, cpus: int | None = None, environ: Mapping[str, str] | None = None) -> None:
        super().__init__(node)
        self.cpus = cpus
        self.names = [name for name in BOOTSTRAP_NAMES if name in (environ or {})]

    def argv(self, command: Sequence[str]) -> list[str]:
        argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={self.name}", "--unbuffered",
                f"--export={','.join(self.names) or 'NONE'}"]
        if self.cpus:
            argv.append(f"--cpus-per-task={self.cpus}")
        return [*argv, *command]

    def own_failure(self, code: int, last: str, quiet_s: float | None = None) -> str | None:
        return last if last.startswith("srun: error") else None  # srun's own words, not the command's


class LocalTransport(Transport):
    """A process on this machine (a job's instance, each its own node)."""

    over = "from its process"

    def argv(self, command: Sequence[str]) -> list[str]:
        return list(command)
