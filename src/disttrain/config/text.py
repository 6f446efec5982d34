"""What a name, path or value a user gives may hold: checked whole, at every door.

Every door (a YAML job spec, ``disttrain.Job(**fields)``, the SageMaker estimators and
``fit(job_name=)``, command-line flags) checks with these functions, so the rules and their
messages have one owner. A rule is matched against the *whole* text (``re.fullmatch``:
``re.match`` with ``$`` accepts a trailing newline, which then became a folder ``hj\\n-...``
or a variable ``SM_CHANNEL_TRAINING\\n``). Names and paths hold no control character (NUL,
newline, escape...) and have a length limit named in the message; values (hyperparameters,
environment variables) may hold any text but NUL, which no process argument or environment
variable can carry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import UsageError

MAX_PATH = 4096  # PATH_MAX: the longest path the kernel takes
MAX_COMPONENT = 255  # NAME_MAX: the longest file name (one path component), in bytes
MAX_SHORT = 256  # instance types, Slurm values, ssh options: short words
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0 (NUL, tab, newline, ESC...), DEL and C1
_SHOWN = 60  # characters of a bad value quoted in a message (a 10 KB value stays one short line)


def shown(value: Any) -> str:
    """``repr(value)``, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def check_text(key: str, value: Any, *, max_len: int = MAX_SHORT, empty_ok: bool = False) -> str:
    """A string of at most ``max_len`` characters, without control characters (newline and NUL included)."""
    if not isinstance(value, str) or (not value and not empty_ok):
        raise UsageError(f"{key} must be a non-empty string, got {shown(value)}")
    bad = _CONTROL.search(value)
    if bad:
        raise UsageError(f"{key} must not contain control characters (NUL, newline, tab...): "
                         f"{bad.group()!r} at position {bad.start()} of {shown(value)}")
    if len(value) > max_len:
        raise UsageError(f"{key} is {len(value)} characters long; the limit is {max_len}")
    return value


def check_path(key: str, value: Any) -> str:
    """A local path or URL: :func:`check_text` with PATH_MAX, and no component longer than NAME_MAX."""
    check_text(key, value, max_len=MAX_PATH)
    longest = max(value.split("/"), key=lambda part: len(part.encode()))
    if len(longest.encode()) > MAX_COMPONENT:
        raise UsageError(f"{key} has a component of {len(longest.encode())} bytes ({shown(longest)}); "
                         f"a file name may have at most {MAX_COMPONENT}")
    return value


def check_pattern(key: str, value: Any, rule: re.Pattern[str], described: str, *, max_len: int) -> str:
    """A name matching ``rule`` whole (``described`` says the rule in words), at most ``max_len`` long."""
    if not isinstance(value, str) or not rule.fullmatch(value):
        raise UsageError(f"{key} must be {described}, got {shown(value)}")
    if len(value) > max_len:
        raise UsageError(f"{key} is {len(value)} characters long; the limit is {max_len}")
    return value


def check_value(key: str, value: Any) -> None:
    """Any text but NUL, at any depth of a list or mapping (a NUL cannot reach a process's argv or environment)."""
    if isinstance(value, str):
        if "\x00" in value:
            raise UsageError(f"{key} contains a NUL byte (position {value.index(chr(0))}), which no process "
                             "argument or environment variable can carry; remove it")
    elif isinstance(value, Mapping):
        for inner_key, inner in value.items():
            check_value(f"{key}[{shown(inner_key)}]", inner_key)
            check_value(f"{key}[{shown(inner_key)}]", inner)
    elif isinstance(value, (list, tuple)):
        for index, inner in enumerate(value):
            check_value(f"{key}[{index}]", inner)
