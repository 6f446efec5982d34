"""The docs are checked like code: the site builds strictly, every option and environment variable is documented
and every documented one is real, and the outputs shown on the pages are what the commands print.

What the pages declare for these checks (HTML comments, invisible on the site and on GitHub):

- ``<!-- options: disttrain run -->`` above a table: its first column lists options of that command (code spans;
  ``-n``, ``--nproc-per-node N``). Every public option of every command must be in one such table, and every
  option in one must exist (hidden options, e.g. the deprecated ``--backend``, may be documented; they need not).
- ``<!-- env -->`` above a table: its first column lists environment variables (``PET_<DEST>`` is a template,
  ``SSH_*`` a prefix). Every variable disttrain reads must be in one, and every one documented must be read.
- ``<!-- rerun -->`` above a fenced block that starts with ``$ command``: the test runs the command and compares
  what it prints with the block, after normalising run folders, ports, times, pids and the host name. In the
  block, a line ``...`` stands for any lines and ``...`` inside a line for any text.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "disttrain"
README = ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md"))
README_MAX_LINES = 250
README_DOOR_WIDTH = 90
# The host the pages' outputs were recorded on; it and this machine's name both read as <HOST>.
RECORDED_HOST = "vm"

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="the docs site needs mkdocs and mkdocs-material (pip install -e '.[docs]')",
)


# ---------------------------------------------------------------------------------------------- the site


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True, text=True, timeout=300, cwd=config.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"},
    )


@needs_mkdocs
@pytest.mark.timeout(300)
def test_site_builds_strictly(tmp_path: Path):
    r = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    for page in PAGES:
        built = page.stem + "/index.html" if page.stem != "index" else "index.html"
        assert (tmp_path / "site" / built).is_file(), f"{page.name} was not built"


def _copy_site(tmp_path: Path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(DOCS, root / "docs")
    shutil.copy2(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    return root


@needs_mkdocs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["broken link", "broken anchor", "orphan page", "absolute link"])
def test_strict_build_fails_on(tmp_path: Path, fault: str):
    """The checks above are only as good as mkdocs' validation settings: each fault must fail the build."""
    root = _copy_site(tmp_path)
    page = root / "docs" / "run.md"
    text = page.read_text()
    if fault == "broken link":
        page.write_text(text + "\nSee [the moon](moon.md).\n")
        expect = "moon.md"
    elif fault == "broken anchor":
        page.write_text(text + "\nSee [hosts](hosts.md#no-such-section).\n")
        expect = "no-such-section"
    elif fault == "orphan page":
        (root / "docs" / "orphan.md").write_text("# Nobody links here\n")
        expect = "orphan.md"
    else:
        page.write_text(text + "\nSee [the home page](/index.md).\n")
        expect = "/index.md"
    r = mkdocs_build(root / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0, f"mkdocs build --strict passed with a {fault}"
    assert expect in r.stderr, r.stderr[-2000:]


# -------------------------------------------------------------------------------------------- the README

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_short_and_its_links_resolve():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    assert lines[2] == "```bash" and lines[3].startswith("make demo") and lines[4].startswith("make test"), \
        "the README starts with the two commands: make demo, make test"
    # GitHub's README column at 1280 px shows about 95 characters of a code line: the door's block shows whole
    assert max(len(lines[3]), len(lines[4])) <= README_DOOR_WIDTH, \
        f"the README's two commands are wider than {README_DOOR_WIDTH} characters: cut on GitHub at 1280 px"
    for target in LINK.findall(README.read_text()):
        if "://" in target or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"
        if anchor and path.endswith(".md"):
            assert anchor in _anchors(ROOT / path), f"README.md links to {target}: no such heading"


# "the README's *Quick start* section", "*Strategies* section": a heading named in prose, checked like a link.
SECTION_REF = re.compile(r"(?:\b([\w.-]+)'s )?\*([^*\n]+)\* section")


def _headings(page: Path) -> set[str]:
    """Each heading's text as a reader sees it (no backticks or emphasis)."""
    return {re.sub(r"[`*_]", "", m.group(1)).strip() for line in _outside_fences(page.read_text())
            if (m := re.match(r"#{1,6}\s+(.*?)\s*#*$", line))}


def test_prose_references_to_sections_resolve():
    unresolved = []
    for page in [README, *PAGES]:
        text = re.sub(r"`[^`]*`", "", " ".join(_outside_fences(page.read_text())))  # code spans show, not cite
        for owner, title in SECTION_REF.findall(text):
            target = {"README": README, "": page}.get(owner, DOCS / owner)
            if owner and owner != "README" and not owner.endswith(".md"):
                target = page  # "the page's *X* section", "this guide's"
            if not target.exists() or title.strip() not in _headings(target):
                unresolved.append(f"{page.name}: *{title}* section ({target.name} has no such heading)")
    assert not unresolved, "prose names sections that do not exist: " + "; ".join(unresolved)


def test_prose_reference_check_catches_a_missing_section(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n## Real one\n\nSee the README's *Surviving failures* section and the *Real one* "
                    "section.\n")
    refs = SECTION_REF.findall(" ".join(_outside_fences(page.read_text())))
    assert refs == [("README", "Surviving failures"), ("", "Real one")]
    assert "Surviving failures" not in _headings(README) and "Real one" in _headings(page)


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs' toc extension gives the page's headings (its default slugify)."""
    ids = set()
    for line in _outside_fences(page.read_text()):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            text = re.sub(r"[`*_\[\]]|\(.*?\)", "", m.group(1)).lower()  # what markdown renders as text
            ids.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip()))
    return ids


def _outside_fences(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


# ------------------------------------------------------------------------------ marked tables on the pages

MARKER = re.compile(r"^<!--\s*(options|env|rerun|excerpt)\b:?\s*(.*?)\s*-->\s*$")
CODE = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Marked:
    kind: str
    arg: str
    page: str
    line: int
    body: list[str]  # the table's rows, or the fenced block's lines


def marked() -> list[Marked]:
    found = []
    for page in [README, *PAGES]:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARKER.match(line.strip())
            if not m:
                continue
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            body = []
            if m.group(1) in ("rerun", "excerpt"):
                assert j < len(lines) and lines[j].startswith("```"), f"{page.name}:{i + 1}: a fence must follow"
                j += 1
                while j < len(lines) and not lines[j].startswith("```"):
                    body.append(lines[j])
                    j += 1
            else:
                while j < len(lines) and lines[j].startswith("|"):
                    body.append(lines[j])
                    j += 1
                assert len(body) > 2, f"{page.name}:{i + 1}: the marker needs a table right below it"
                body = body[2:]  # the header and the --- line
            found.append(Marked(m.group(1), m.group(2), page.name, i + 1, body))
    return found


def first_cells(rows: list[str]) -> list[str]:
    """The code spans of each row's first cell (``\\|`` is a pipe inside a cell)."""
    spans = []
    for row in rows:
        cell = re.split(r"(?<!\\)\|", row.strip().strip("|"))[0]
        spans += [span.replace("\\|", "|") for span in CODE.findall(cell)]
    return spans


# ------------------------------------------------------------------------------------- every option, both ways

OPTION = re.compile(r"^--?[A-Za-z][\w-]*$")


def cli_options() -> dict[str, tuple[set[str], set[str]]]:
    """``{"disttrain run": (public option strings, every option string)}`` for every public command."""
    from disttrain.cli.main import HIDDEN, build_parser

    commands: dict[str, tuple[set[str], set[str]]] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        public, every = set(), set()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    if sub not in HIDDEN:
                        walk(subparser, f"{name} {sub}")
                continue
            if isinstance(action, argparse._HelpAction):
                continue
            every |= set(action.option_strings)
            if action.help != argparse.SUPPRESS:
                # torchrun's underscore spellings are aliases the pages name once, as "both spellings"
                public |= {o for o in action.option_strings if "_" not in o}
        if every:
            commands[name] = (public, every)

    walk(build_parser(), "disttrain")
    return commands


def documented_options() -> dict[str, dict[str, str]]:
    """``{command: {option: "page:line"}}`` from every ``<!-- options: COMMAND -->`` table."""
    docs: dict[str, dict[str, str]] = {}
    for m in marked():
        if m.kind != "options":
            continue
        for span in first_cells(m.body):
            for word in re.split(r"[\s,/=\[\]]+", span):
                if OPTION.match(word):
                    docs.setdefault(m.arg, {}).setdefault(word, f"{m.page}:{m.line}")
    return docs


def test_every_option_is_documented():
    docs = documented_options()
    missing = [f"{cmd} {opt}" for cmd, (public, _) in cli_options().items() for opt in sorted(public)
               if opt not in docs.get(cmd, {})]
    assert not missing, "options no page documents (add them to an <!-- options: COMMAND --> table): " + \
        ", ".join(missing)


def test_every_documented_option_is_real():
    real = cli_options()
    unknown = [f"{where}: {cmd} {opt}" for cmd, options in documented_options().items()
               for opt, where in options.items() if opt not in real.get(cmd, (set(), set()))[1]]
    assert not unknown, "documented options that no parser has: " + ", ".join(unknown)


# ------------------------------------------------------------------------ every environment variable, both ways

ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")


def _is_environ(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.lower().endswith("environ") or name == "getenv"


def _environ_keys(node: ast.AST) -> list[ast.AST]:
    """The key expressions ``node`` reads from something called ``environ``: ``environ.get(K)``,
    ``environ[K]``, ``K in environ``, ``f(environ, K)``, ``os.getenv(K)``."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and _is_environ(func.value) \
                or _is_environ(func):
            return node.args[:1]
        if any(_is_environ(arg) for arg in node.args):
            return list(node.args)
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
        return [node.slice]
    elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
        return [node.left]
    return []


def _text(node: ast.AST, constants: dict[str, str]) -> str | None:
    """A string literal, or a module constant naming one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return constants.get(node.id) if isinstance(node, ast.Name) else None


def source_variables() -> tuple[set[str], set[str]]:
    """(the variables disttrain reads: each must be on a page; every string constant in src/: a page may name those).

    Read: every ``DISTTRAIN_*`` constant in src/ (outside ``__all__``); every constant -- a literal, or a module
    constant naming one -- that is a key read from something called ``environ`` (see ``_environ_keys``), or, when
    the key is a ``for`` loop's variable, the constants the loop goes over; and torchrun's ``PET_<DEST>``
    variables, made from its option table. Names only written for the workers or a job's script (``SM_*``) are
    not reads: they may be documented, as constants of src/, and need not be."""
    from disttrain.config import torchrun

    read, constants = set(), set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        module_constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                            for t in node.targets if isinstance(t, ast.Name)}
        exported = {id(elt) for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                    for elt in ast.walk(node.value)}
        loops = {name.id: loop.iter for loop in ast.walk(tree) if isinstance(loop, ast.For)
                 for name in ast.walk(loop.target) if isinstance(name, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exported:
                constants.add(node.value)
                if node.value.startswith("DISTTRAIN_") and ENV_NAME.match(node.value):
                    read.add(node.value)
            for key in _environ_keys(node):
                candidates = [key]
                if isinstance(key, ast.Name) and key.id in loops:
                    candidates = [c for c in ast.walk(loops[key.id]) if isinstance(c, ast.Constant)]
                for candidate in candidates:
                    text = _text(candidate, module_constants)
                    if text and re.fullmatch(r"[A-Z][A-Z0-9_]*", text):
                        read.add(text)
    pet = {torchrun.env_name(option.dest) for option in torchrun.OPTIONS}
    return read | pet, constants | pet


def documented_variables() -> dict[str, str]:
    """``{name or pattern: "page:line"}`` from every ``<!-- env -->`` table."""
    docs: dict[str, str] = {}
    for m in marked():
        if m.kind == "env":
            for span in first_cells(m.body):
                for word in re.split(r"[\s,=]+", span):
                    if re.fullmatch(r"[A-Z][A-Z0-9_]*(<[A-Z_]+>[A-Z0-9_]*)?\*?", word):
                        docs.setdefault(word, f"{m.page}:{m.line}")
    return docs


def _pattern(doc: str) -> re.Pattern:
    text = re.escape(doc).replace(r"\*", "[A-Z0-9_]*")
    return re.compile("^" + re.sub(r"<[A-Z_]+>", "[A-Z0-9_]+", text) + "$")


def test_every_variable_disttrain_reads_is_documented():
    read, _ = source_variables()
    patterns = [_pattern(doc) for doc in documented_variables()]
    missing = sorted(name for name in read if not any(p.match(name) for p in patterns))
    assert not missing, "variables disttrain reads that no <!-- env --> table names: " + ", ".join(missing)


def test_every_documented_variable_is_real():
    read, constants = source_variables()
    unknown = []
    for doc, where in documented_variables().items():
        if doc.endswith("*"):  # a prefix: src/ must name it (NOT_FORWARDED_PREFIXES, ESSENTIAL_PREFIXES, ...)
            real = doc[:-1] in constants
        elif "<" in doc:
            real = any(_pattern(doc).match(name) for name in read)
        else:
            real = doc in read or doc in constants
        if not real:
            unknown.append(f"{where}: {doc}")
    assert not unknown, "documented variables that src/ never names: " + ", ".join(unknown)


# ------------------------------------------------------------------------------------ excerpts, the runtime


EXCERPTS = [m for m in marked() if m.kind == "excerpt"]


@pytest.mark.parametrize("block", EXCERPTS, ids=[f"{m.page}:{m.line}" for m in EXCERPTS])
def test_excerpt_is_the_file_as_it_is(block: Marked):
    source = [line.rstrip() for line in (ROOT / block.arg).read_text().splitlines()]
    shown = [line.rstrip() for line in block.body]
    n = len(shown)
    assert any(source[i:i + n] == shown for i in range(len(source) - n + 1)), \
        f"{block.page}:{block.line}: the block is not a run of lines of {block.arg} as it is now"


def test_every_name_the_runtime_exports_is_on_its_page():
    import disttrain

    page = (DOCS / "api.md").read_text()
    shown = {word for span in CODE.findall(page) for word in re.findall(r"\w+", span)}
    missing = [name for name in disttrain.__all__ if name != "__version__" and name not in shown]
    assert not missing, "disttrain exports these, and docs/api.md does not name them: " + ", ".join(missing)


# ---------------------------------------------------------------------------------------- outputs, rerun

RERUNS = [m for m in marked() if m.kind == "rerun"]


def normalise(text: str, *, home: str | None = None) -> list[str]:
    """What may differ between two runs of the same command, made alike; blanks collapsed (columns shift
    with the host name's length)."""
    if home:
        text = text.replace(home, "~/.disttrain")
    text = text.replace(f"{ROOT}/", "").replace(str(ROOT), ".")
    text = re.sub(r"(/root|/home/[\w.-]+)/\.disttrain", "~/.disttrain", text)
    text = re.sub(r"\b\d{8}-\d{6}-([\w.-]+?)-[0-9a-f]{4}\b", r"<DATE>-\1-<ID>", text)
    text = re.sub(r"\b(127\.0\.0\.1|localhost|port|rendezvous [\d.]+):\d{2,5}\b", r"\1:<PORT>", text)
    text = re.sub(r"(\"(?:master_)?port\": |\bport )\d{2,5}\b", r"\1<PORT>", text)
    text = re.sub(r"\bpid \d+", "pid <PID>", text)
    text = re.sub(r"\b\d+(\.\d+)? s\b", "<T> s", text)
    for host in {socket.gethostname(), RECORDED_HOST}:
        text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w.-])", "<HOST>", text)
    return [" ".join(line.split()) for line in text.strip("\n").splitlines()]


# A number with a fractional part (2.1465, 2.1464616537094114, 3.2e-05): compared to the precision the
# block's marker states (``<!-- rerun: floats to 4 digits -->``), as a float computed the same way may
# differ in its last digits on another CPU (vectorised sums in another order).
FLOAT = re.compile(r"[-+]?\d+\.\d+(?:[eE][-+]?\d+)?")
PRECISION = re.compile(r"floats to (\d+) digits")


def digits_of(marker_arg: str) -> int | None:
    m = PRECISION.fullmatch(marker_arg.strip())
    assert m or not marker_arg.strip(), f"unknown rerun marker argument {marker_arg!r} (floats to N digits)"
    return int(m.group(1)) if m else None


def _line_matches(head: str, line: str, digits: int | None) -> bool:
    pieces = head.split("...")
    if digits is None:
        return re.fullmatch(".*?".join(map(re.escape, pieces)), line) is not None
    wanted, patterns = [], []
    for piece in pieces:  # each float of the page becomes a group, its value compared below
        pattern, at = "", 0
        for m in FLOAT.finditer(piece):
            pattern += re.escape(piece[at:m.start()]) + f"({FLOAT.pattern})"
            wanted.append(float(m.group()))
            at = m.end()
        patterns.append(pattern + re.escape(piece[at:]))
    found = re.fullmatch(".*?".join(patterns), line)
    return found is not None and all(math.isclose(float(got), want, rel_tol=10.0 ** -digits)
                                     for got, want in zip(found.groups(), wanted))


def matches(expected: list[str], actual: list[str], digits: int | None = None) -> bool:
    """``...`` alone on a line: any lines; ``...`` inside a line: any text; with ``digits``, numbers
    with a fractional part agree to that many significant digits."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head == "...":
        return any(matches(rest, actual[i:], digits) for i in range(len(actual) + 1))
    if not actual:
        return False
    return _line_matches(head, actual[0], digits) and matches(rest, actual[1:], digits)


def test_floats_compare_to_the_stated_precision():
    page = ['[rank0] {"epochs": 1, ..., "train_loss": 2.1464616537094114, "val_accuracy": 0.59}']
    other_cpu = ['[rank0] {"epochs": 1, "world_size": 2, "train_loss": 2.1464616457621255, "val_accuracy": 0.59}']
    assert not matches(page, other_cpu)  # bit for bit: true on one machine only
    assert matches(page, other_cpu, digits=6) and matches(page, other_cpu, digits=4)
    assert not matches(page, [other_cpu[0].replace("2.14646164", "2.15")], digits=4)  # a real change
    assert not matches(page, [other_cpu[0].replace('"epochs": 1', '"epochs": 2')], digits=4)  # integers exact
    assert matches(["loss 2.1465, 2.2 s ..."], ["loss 2.1464, 2.2 s and more"], digits=4)  # a rounding flip


def commands_and_outputs(block: list[str]) -> list[tuple[str, list[str]]]:
    """``$ cmd`` lines (``\\`` continues them) and the output below each."""
    runs: list[tuple[str, list[str]]] = []
    lines = iter(block)
    for line in lines:
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                command = command[:-1] + " " + next(lines).strip()
            runs.append((command, []))
        else:
            assert runs, f"output before any $ command: {line!r}"
            runs[-1][1].append(line)
    return runs


_printed: dict[str, list[str]] = {}  # a command shown on two pages runs once


def run_as_on_the_page(command: str, tmp: Path) -> list[str]:
    if command in _printed:
        return _printed[command]
    home, bindir = tmp / "home", tmp / "bin"
    bindir.mkdir(exist_ok=True)
    # `disttrain` and `python` on the page are this interpreter and this checkout.
    (bindir / "disttrain").write_text(f'#!/bin/sh\nexec {sys.executable} -m disttrain "$@"\n')
    (bindir / "disttrain").chmod(0o755)
    if not (bindir / "python").exists():
        (bindir / "python").symlink_to(sys.executable)
    env = {**os.environ, "DISTTRAIN_HOME": str(home), "PATH": f"{bindir}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("OMP_NUM_THREADS", None)  # the page shows what a user's shell gets
    # Its own process group, so that whatever it started goes with it, even after a timeout.
    proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _printed[command] = normalise(out, home=str(home))
    return _printed[command]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RERUNS, ids=[f"{m.page}:{m.line}" for m in RERUNS])
def test_output_on_the_page_is_what_the_command_prints(block: Marked, tmp_path: Path):
    for command, expected in commands_and_outputs(block.body):
        got = run_as_on_the_page(command, tmp_path)
        want = normalise("\n".join(expected))
        assert matches(want, got, digits_of(block.arg)), \
            f"{block.page}:{block.line}: `{command}` now prints:\n" + "\n".join(got) + \
            "\n\nthe page shows (normalised):\n" + "\n".join(want)
