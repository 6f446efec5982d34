"""TCP reachability between hosts: the checks that stop a job from hanging.

gloo and NCCL first meet at the master's rendezvous port, then connect every pair of ranks
on ephemeral ports. A firewall that lets ssh and the master port through but drops the rest
makes the rendezvous succeed and the job hang forever. So each host listens on the
master port (the master) and on a random port (everyone), and every host connects to every
other host's listeners, with a short timeout.

Both halves run on the hosts themselves, in each host's probe session (``disttrain agent``,
see :mod:`disttrain.agent.entry`).
"""

from __future__ import annotations

import socket
import threading

from ..wire import Listening

CONNECT_TIMEOUT_S = 3.0


def open_listeners(ports: list[int]) -> tuple[list[socket.socket], Listening]:
    """Listen on ``ports`` (0: a free one), accepting in the background; the sockets, and
    the ports or why not."""
    socks = []
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as err:
            sock.close()
            for other in socks:
                other.close()
            return [], Listening(error=f"cannot listen on port {port}: {err.strerror}")
        sock.listen(64)
        socks.append(sock)

    def accept(sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.close()

    for sock in socks:
        threading.Thread(target=accept, args=(sock,), daemon=True).start()
    return socks, Listening(ports=tuple(s.getsockname()[1] for s in socks))


def close_listeners(socks: list[socket.socket]) -> None:
    """Free the ports now (the master port is the rendezvous' next): shutdown wakes the
    accepting thread, whose pending accept() would otherwise keep the port listening."""
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def connect(targets: list[str], timeout: float = CONNECT_TIMEOUT_S) -> dict[str, str]:
    """``{"addr:port": "ok" | why}`` for each target, tried in parallel."""
    results: dict[str, str] = {}

    def attempt(target: str) -> None:
        host, _, port = target.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                results[target] = "ok"
        except TimeoutError:
            results[target] = f"timed out after {timeout:.0f} s (packets dropped)"
        except OSError as err:
            results[target] = err.strerror or str(err)

    threads = [threading.Thread(target=attempt, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
