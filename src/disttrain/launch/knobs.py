"""The launcher's knobs of seconds from its environment: read whole, or refused in one line before
any host is asked."""

from __future__ import annotations

import math
import os

from ..errors import UsageError
from .policies import BACKOFF_FIRST_S, BACKOFF_MAX_S, PROBE_TIMEOUT_S, SLOW_S, Backoff


def seconds_knob(name: str, default: float) -> float:
    """A launcher's knob of seconds above 0 from the environment, ``default`` when unset; anything
    else is one line."""
    given = os.environ.get(name)
    if given is None:
        return default
    try:
        seconds = float(given)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < math.inf:
        raise UsageError(f"{name}={given!r} is not a number of seconds above 0 (the default is {default:g})")
    return seconds


def slow_limit() -> float:
    """How long an agent kept alive by ssh may be silent, its round not stepping, before its host is
    lost: ``DISTTRAIN_SLOW_S`` or :data:`SLOW_S`."""
    return seconds_knob("DISTTRAIN_SLOW_S", SLOW_S)


def probe_limit() -> float:
    """How long a silent agent's host has to take a TCP connection before it is lost:
    ``DISTTRAIN_PROBE_S`` or :data:`PROBE_TIMEOUT_S` (more where a link's queue holds longer)."""
    return seconds_knob("DISTTRAIN_PROBE_S", PROBE_TIMEOUT_S)


def backoff() -> Backoff:
    """A flapping host's wait before it is let in again: ``DISTTRAIN_BACKOFF_S`` or
    :data:`BACKOFF_FIRST_S` at first, doubled each flap, up to :data:`BACKOFF_MAX_S` (or the first, if more)."""
    first = seconds_knob("DISTTRAIN_BACKOFF_S", BACKOFF_FIRST_S)
    return Backoff(first_s=first, max_s=max(first, BACKOFF_MAX_S))
