"""Tarballs are extracted by disttrain's own rules, the same on every Python.

Python's ``filter="data"`` exists only from 3.10.12/3.11.4/3.12; disttrain supports older
ones, so each test also runs with the filter hidden, as on those interpreters.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from conftest import cli_env, disttrain
from disttrain.errors import UsageError
from disttrain.jobs.tarballs import safe_extract

D5 = "d1/d2/d3/d4/d5"


@pytest.fixture(params=["data filter present", "no data filter (old Python)"])
def old_python(request, monkeypatch):
    if request.param.startswith("no") and hasattr(tarfile, "data_filter"):
        monkeypatch.delattr(tarfile, "data_filter")
    return request.param


def make_tar(path: Path, members: list[tuple[str, str, str | None]]) -> Path:
    """``members``: (name, kind, link target or file text); kind is file, dir, sym or hard."""
    kinds = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE}
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, extra in members:
            info = tarfile.TarInfo(name)
            info.type = kinds[kind]
            info.mode = 0o755 if kind == "dir" else 0o644
            if kind in ("sym", "hard"):
                info.linkname = extra
                tar.addfile(info)
            elif kind == "file":
                data = (extra or "x").encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def symlink_chain() -> list[tuple[str, str, str | None]]:
    """The attack from issue 17: every member's name and target look harmless on their own."""
    return [
        *[("/".join(D5.split("/")[:i]), "dir", None) for i in range(1, 6)],
        (f"{D5}/l1", "sym", "../../../.."),
        ("s", "sym", f"{D5}/l1/../../../../.."),
        ("s/evil", "file", "pwned"),
    ]


def test_symlink_chain_is_refused_on_every_python(tmp_path, old_python):
    dest = tmp_path / "a" / "b" / "c" / "d" / "job"
    archive = make_tar(tmp_path / "chain.tar.gz", symlink_chain())
    with pytest.raises(UsageError, match=r"refusing to extract .*: member 's' links outside the destination"):
        safe_extract(archive, dest)
    assert not list(tmp_path.rglob("evil"))
    assert not dest.exists()  # refused before anything was written


@pytest.mark.parametrize("members, reason", [
    # a link that stays inside until a later, harmless-looking link turns it into a way out
    ([("a", "sym", "x/y/../.."), ("x", "sym", ".")], "links outside the destination \\(to 'x/y/../..'\\)"),
    ([("x", "sym", "."), ("x/x/x/../../../../esc", "file", None)], "climbs out with '..'"),
    ([("l", "sym", "sub"), ("sub", "sym", ".."), ("l/evil", "file", None)], "would land outside|links outside"),
    ([("f", "file", "a"), ("f", "sym", "/etc/passwd")], "links outside the destination"),
    ([("l", "sym", "f"), ("l", "file", "through the link")], "would replace a link"),
    ([("loop", "sym", "loop"), ("loop/x", "file", None)], "too many links|links outside"),
    ([("hard", "hard", "missing.txt")], "is a hard link to 'missing.txt', which is not a file earlier"),
    ([("l", "sym", "."), ("h", "hard", "l")], "not a file earlier in the archive"),
])
def test_link_tricks_are_refused(tmp_path, old_python, members, reason):
    dest = tmp_path / "out" / "job"
    archive = make_tar(tmp_path / "t.tar.gz", members)
    with pytest.raises(UsageError, match=reason):
        safe_extract(archive, dest)
    assert not dest.exists()


def test_links_inside_are_kept(tmp_path, old_python):
    archive = make_tar(tmp_path / "ok.tar.gz", [
        ("pkg", "dir", None), ("pkg/data.txt", "file", "hello"), ("alias", "sym", "pkg"),
        ("alias/more.txt", "file", "more"), ("deep/copy.txt", "hard", "pkg/data.txt"),
        ("up", "sym", "pkg/../pkg/data.txt"), ("pkg/data.txt", "file", "hello again"),
    ])
    dest = safe_extract(archive, tmp_path / "job")
    assert (dest / "pkg" / "more.txt").read_text() == "more"  # written through the inside link
    assert (dest / "deep" / "copy.txt").read_text() == "hello"  # hard link to the first version
    assert (dest / "up").read_text() == "hello again"
    assert (dest / "alias").is_symlink()


def test_setuid_and_world_writable_bits_are_dropped(tmp_path, old_python):
    path = tmp_path / "m.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("tool")
        info.mode, info.size = 0o6777, 1
        tar.addfile(info, io.BytesIO(b"x"))
    dest = safe_extract(path, tmp_path / "job")
    assert (dest / "tool").stat().st_mode & 0o7777 == 0o755


@pytest.mark.timeout(60)
def test_hard_link_to_missing_member_is_one_line_exit_2(tmp_path):
    archive = make_tar(tmp_path / "src.tar.gz", [("train.py", "hard", "nowhere.py")])
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: hl\nentry_point: train.py\nsource_dir: {archive}\n")
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    result = disttrain("job", "run", str(spec), env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "disttrain bug" not in result.stderr
    assert "member 'train.py' is a hard link to 'nowhere.py'" in result.stderr
