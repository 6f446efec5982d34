"""Riding out a checkpoint store's outage: which errors are transient, and the bounded retry.

A store that refuses or resets connections, throttles, or answers 5xx is usually back within
seconds to a minute (a restarted server, a failover, a burst of requests). Each store operation of
:mod:`disttrain.checkpoint_url` is retried with backoff until ``retry_s`` have passed since the
first failure (default 120 s; ``--checkpoint-retry-s``): one line says the store is unreachable,
one line that it is back. Meanwhile an asynchronous save's upload waits on its thread and training
goes on; the next save waits for it. Past the bound the error is raised as before, and the step's
objects never get their marker, so resume cannot take them. Anything else (missing credentials, a
missing bucket, a refused request) is not retried. Torch-free; clock and sleep injectable.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import one_line

DEFAULT_RETRY_S = 120.0  # rides out a 60 s outage, with room for the backoff and a slow store
FIRST_WAIT_S = 0.5
MAX_WAIT_S = 5.0

# Connection-level failures, by class name: botocore, aiohttp, urllib3, requests, fsspec and the stdlib.
TRANSIENT_TYPES = frozenset({
    "EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError",
    "ProxyConnectionError", "ClientConnectorError", "ClientConnectionError", "ServerDisconnectedError",
    "ClientOSError", "ClientPayloadError", "ServerTimeoutError", "ConnectionRefusedError",
    "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "TimeoutError", "FSTimeoutError",
    "IncompleteRead", "ProtocolError", "NewConnectionError", "RemoteDisconnected", "ResponseParserError",
})
# Error codes a store answers with while it is overloaded or failing over.
TRANSIENT_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "SlowDown", "RequestLimitExceeded",
    "TooManyRequests", "TooManyRequestsException", "RequestThrottled", "RequestTimeout",
    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "ServiceUnavailableException",
    "BandwidthLimitExceeded", "500", "502", "503", "504",
})

T = TypeVar("T")


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) says the store is unreachable or overloaded
    for now -- worth waiting for -- rather than that the request itself is wrong."""
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in seen:
        seen.append(current)
        if type(current).__name__ in TRANSIENT_TYPES:
            return True
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in TRANSIENT_CODES or (isinstance(status, int) and (status >= 500 or status == 429)):
                return True
        status = getattr(current, "status", None)  # aiohttp's ClientResponseError, gcsfs' HttpError
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
        current = current.__cause__ or current.__context__
    return False


class StoreRetry:
    """Runs store operations, retrying transient failures for up to ``retry_s`` seconds of outage.
    Shared by the threads of one process that reach one store (``where``), so that an outage is
    told once: ``say`` gets one "unreachable" line when it starts and one "back" line when an
    operation succeeds again. Nested operations (an upload that reads its object back) retry only
    at the outermost, where the whole operation can be done again."""

    def __init__(self, where: str, retry_s: float = DEFAULT_RETRY_S, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] | None = None) -> None:
        self.where = where
        self.retry_s = retry_s
        self.clock = clock
        self.sleep = sleep
        self.say = say or _stderr
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._depth = threading.local()

    def call(self, operation: Callable[[], T]) -> T:
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        try:
            if depth:
                return operation()
            return self._retried(operation)
        finally:
            self._depth.n = depth

    def _retried(self, operation: Callable[[], T]) -> T:
        wait = FIRST_WAIT_S
        while True:
            try:
                result = operation()
            except Exception as err:
                if not is_transient(err) or not self._ride_out(err):
                    raise
                self.sleep(wait)
                wait = min(MAX_WAIT_S, wait * 2)
                continue
            self._back()
            return result

    def _ride_out(self, err: BaseException) -> bool:
        """Note the outage (told once); False once it has lasted ``retry_s``."""
        now = self.clock()
        with self._lock:
            if self._down_since is None:
                if self.retry_s <= 0:
                    return False
                self._down_since = now
                self.say(f"disttrain: checkpoint store {self.where} unreachable ({one_line(err)}); retrying for "
                         f"up to {self.retry_s:g} s while training goes on (--checkpoint-retry-s)")
            return now - self._down_since < self.retry_s

    def _back(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            gone = self.clock() - self._down_since
            self._down_since = None
        self.say(f"disttrain: checkpoint store {self.where} back after {gone:.0f} s")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def retrying(retry: StoreRetry | None, operation: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``operation(*args, **kwargs)``, through ``retry`` when there is one."""
    if retry is None:
        return operation(*args, **kwargs)
    return retry.call(lambda: operation(*args, **kwargs))
