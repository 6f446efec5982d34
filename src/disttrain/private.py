"""What stays private: files that may hold a user's secrets are 0600, and records mask them.

A run's folder and a new checkpoint folder are 0700, the rank logs and checkpoint files in them
0600: a script prints a token, a checkpoint holds the model's weights. A folder that exists
already keeps its mode (the user chose it, e.g. a group-readable shared folder).

A job's ``env:`` often carries an API token, its ``storage_options`` a cloud key. The files
that hold them whole (a plan, a Slurm batch step, the job store) are readable by their owner only;
what is kept for people to read later (a job's record, ``jobs show``) shows ``***`` instead
of any value whose key looks secret, at any depth.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .atomic import write_atomic

# Words of a key (API_TOKEN, aws_secret_access_key, secretKey) that make its value a secret.
# Whole words, so that max_tokens, tokenizer or keyframes stay readable in a record.
SECRET_WORDS = frozenset({"key", "apikey", "secret", "token", "password", "passwd", "pwd", "passphrase",
                          "credential", "credentials"})
# A word ending so is a secret too: PGPASSWORD, dbpasswd, mysqlpwd (no word ends so innocently).
SECRET_ENDINGS = ("password", "passwd", "pwd", "passphrase")
# "pass" only as a key's last word (DB_PASS, dbPass): bypass, lowpass, high_pass_filter stay readable.
LAST_WORD_SECRETS = frozenset({"pass"})
_WORD_BREAK = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
MASK = "***"


def is_secret_key(key: str) -> bool:
    words = [word.lower() for word in _WORD_BREAK.split(key) if word]
    return bool(words) and (words[-1] in LAST_WORD_SECRETS
                            or any(word in SECRET_WORDS or word.endswith(SECRET_ENDINGS) for word in words))


def mask_secrets(value: Any) -> Any:
    """``value`` with every mapping entry whose key looks secret replaced by ``***``."""
    if isinstance(value, Mapping):
        return {k: MASK if isinstance(k, str) and is_secret_key(k) else mask_secrets(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_secrets(v) for v in value]
    return value


# A URL's password (scheme://user:PASSWORD@host), wherever it is written: a tracking URI in a client's message.
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:)(?P<password>[^/@\s]+)@")


def redact_urls(text: str) -> str:
    """``text`` with the password of every URL in it shown as ``***``."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", text)


def mask_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """A command line with the values of secret-looking options masked, by :func:`is_secret_key`'s
    rule (the rule the job records use): ``--db-password X``, ``--api-key=X``, ``DB_PASS=X``, and
    every URL's password."""
    out: list[str] = []
    secret_next = False
    for arg in argv:
        name, eq, _value = arg.lstrip("-").partition("=")
        if secret_next and not arg.startswith("--"):
            out.append(MASK)
        elif eq and is_secret_key(name):
            out.append(arg[:len(arg) - len(_value)] + MASK)
        else:
            out.append(redact_urls(arg))
        secret_next = arg.startswith("-") and not eq and is_secret_key(name)
    return out


def private_opener(path: str | os.PathLike, flags: int) -> int:
    """``open(path, mode, opener=private_opener)``: a file this creates is 0600 from its first byte."""
    return os.open(path, flags, 0o600)


def private_dirs(path: str | os.PathLike) -> Path:
    """Create the folder ``path`` and every missing parent 0700; folders that exist keep their mode."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile (another rank, another agent): its maker chose the mode
    return path


def private_file(path: str | os.PathLike) -> Path:
    """``path`` created empty as 0600, or emptied keeping its inode and mode (a worker's output
    redirect opens it again: both names see one file)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    return Path(path)


def write_private(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` as a 0600 file, atomically (a reader sees all of it or none)."""
    return write_atomic(path, text, mode=0o600)


def make_private(path: str | os.PathLike) -> None:
    """Create ``path`` empty as 0600 if it does not exist; make it 0600 if it does and is ours.

    Never opens ``path`` itself: it may be a SQLite database that this process already has open,
    and closing any descriptor of a file drops every POSIX lock the process holds on it (SQLite's
    locks, then its WAL is checkpointed and deleted under it by another process). A new file is
    made 0600 under a temporary name and hard-linked into place, so it appears private and closed;
    an existing one is only ``chmod``-ed, which touches no lock.
    """
    path = Path(path)
    try:
        if not path.exists():
            _link_new(path)
        if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o777 != 0o600:
            os.chmod(path, 0o600)
    except OSError:
        pass  # the caller's own open reports an unusable path, in its words


def _link_new(path: Path) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".new")  # 0600
    os.close(fd)
    try:
        os.link(temp, path)
    except FileExistsError:
        pass  # made meanwhile by another process: it is the one to use
    except OSError:  # no hard links here (some FUSE file systems): the file is made by its user,
        pass  # then chmod-ed, private from then on
    finally:
        os.unlink(temp)
