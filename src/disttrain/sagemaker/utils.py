"""``sagemaker.utils``: the name helpers notebooks use."""

from __future__ import annotations

import secrets
import time


def sagemaker_timestamp() -> str:
    """``YYYY-MM-DD-HH-MM-SS-mmm``, as the SDK's."""
    now = time.time()
    return time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime(now)) + f"-{int(now * 1000) % 1000:03d}"


def name_from_base(base: str, max_length: int = 63, short: bool = False) -> str:
    stamp = time.strftime("%y%m%d-%H%M", time.gmtime()) if short else sagemaker_timestamp()
    return f"{base[:max_length - len(stamp) - 1]}-{stamp}"


def unique_name_from_base(base: str, max_length: int = 63) -> str:
    suffix = f"{int(time.time())}-{secrets.token_hex(2)}"
    return f"{base[:max_length - len(suffix) - 1]}-{suffix}"


__all__ = ["name_from_base", "sagemaker_timestamp", "unique_name_from_base"]
