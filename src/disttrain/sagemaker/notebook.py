"""``disttrain sagemaker run FILE [ARGS...]``: a SageMaker notebook or script, run untouched.

``import sagemaker`` is served by disttrain in this process only (:mod:`.sdkshim`). A ``.py``
file runs as ``python FILE ARGS`` would. A ``.ipynb`` runs as Jupyter's "Run All": every code
cell in order, in one namespace, in the notebook's folder, each cell's last expression shown;
the first cell that raises stops the run. IPython's syntax is handled as Jupyter would, or
skipped with a note:

- ``!cmd`` and ``x = !cmd`` run through the shell (``{expr}`` and ``$name`` expanded from the
  notebook's variables); a failing command does not stop the notebook, as in Jupyter;
- ``display(...)`` and ``get_ipython()`` (``.system``, ``.run_line_magic``, ...) are there, as
  in every kernel;
- ``%%writefile [-a] PATH``, ``%%bash``/``%%sh``, ``%%time``, ``%cd``, ``%env``, ``%time``,
  ``%load_ext disttrain.sagemaker`` do what they do in Jupyter;
- package installs (``!pip install ...``, ``%pip``, ``%conda``) are skipped with a note: the SDK
  is served by disttrain, and nothing is installed behind your back; other magics
  (``%matplotlib``, ``%autoreload``, ...) are skipped with a note.

An error of the SDK surface (an unknown argument, bad input) is one line naming the cell and
line; an error in the notebook's own code is its traceback, as Jupyter shows it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DisttrainError, UsageError
from . import sdkshim

_LINE_MAGIC = re.compile(r"^(\s*)(?:([A-Za-z_][A-Za-z0-9_]*)\s*=\s*)?([!%])(%?)(.*)$")
_INSTALL = re.compile(r"(^|\s|/)(pip3?|conda|mamba)(\s+\S+)*?\s+install\b|-m\s+pip\s+install\b")
_SILENT = {"matplotlib", "config", "autoreload", "reload_ext", "precision", "pprint", "xmode", "alias_magic"}


@dataclass(frozen=True)
class Cell:
    number: int  # 1-based, counting code cells only
    source: str


def read_notebook(path: Path) -> list[Cell]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read {path}: {err}") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}: not a notebook (invalid JSON at line {err.lineno})") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        raise UsageError(f"{path}: not a Jupyter notebook (no 'cells' list)")
    code = []
    for cell in cells:
        if isinstance(cell, dict) and cell.get("cell_type") == "code":
            source = cell.get("source", "")
            code.append(Cell(len(code) + 1, "".join(source) if isinstance(source, list) else str(source)))
    return code


class Shell:
    """What the transformed cells call (``_disttrain_ipython`` in the notebook's namespace)."""

    def __init__(self, namespace: dict[str, Any], say) -> None:
        self.ns, self.say = namespace, say
        self.cell = 0

    def note(self, what: str, why: str) -> None:
        self.say(f"disttrain: cell {self.cell}: skipped `{what.strip()}` ({why})")

    def expand(self, command: str) -> str:
        """IPython's expansion: ``{expr}`` evaluated in the notebook, ``$name`` its variable, ``$$`` a ``$``."""
        def braces(m: re.Match) -> str:
            try:
                return str(eval(m.group(1), self.ns))  # noqa: S307 - the notebook's own expression
            except Exception:
                return m.group(0)

        def dollar(m: re.Match) -> str:
            name = m.group(1)
            return str(self.ns[name]) if name in self.ns else m.group(0)

        command = re.sub(r"(?<!\{)\{([^{}]+)\}(?!\})", braces, command)
        command = re.sub(r"(?<!\$)\$([A-Za-z_][A-Za-z0-9_]*)", dollar, command)
        return command.replace("$$", "$")

    def system(self, command: str) -> None:
        if _INSTALL.search(command):
            return self.note(f"!{command}", "package installs are not run; the SDK is served by disttrain")
        sys.stdout.flush()
        subprocess.run(["/bin/bash", "-c", self.expand(command)], check=False)

    def getoutput(self, command: str) -> list[str]:
        if _INSTALL.search(command):
            self.note(f"!{command}", "package installs are not run; the SDK is served by disttrain")
            return []
        done = subprocess.run(["/bin/bash", "-c", self.expand(command)], capture_output=True, text=True, check=False)
        return (done.stdout + done.stderr).splitlines()

    # --- what IPython's shell object offers a notebook (``get_ipython().system(...)`` ...) ---
    @property
    def user_ns(self) -> dict[str, Any]:
        return self.ns

    def run_line_magic(self, name: str, line: str) -> Any:
        return self.magic(name, line)

    def run_cell_magic(self, name: str, line: str, cell: str) -> None:
        self.cell_magic(name, line, cell)

    def magic(self, name: str, args: str) -> Any:
        args = args.strip()
        if name in ("pip", "conda", "mamba"):
            return self.note(f"%{name} {args}", "package installs are not run; the SDK is served by disttrain")
        if name == "cd":
            os.chdir(os.path.expanduser(self.expand(args) or "~"))
            print(os.getcwd())
            return None
        if name == "env":
            return self._env(self.expand(args))
        if name in ("time", "timeit"):
            start = time.perf_counter()
            exec(compile(args, f"<cell {self.cell}>", "exec"), self.ns)  # noqa: S102 - the notebook's own code
            print(f"Wall time: {time.perf_counter() - start:.3f} s")
            return None
        if name in ("load_ext", "reload_ext") and args == "disttrain.sagemaker":
            return None  # served already
        if name in ("sx", "system"):
            return self.getoutput(args)
        why = "display settings do not apply here" if name in _SILENT else "not a magic disttrain runs"
        return self.note(f"%{name} {args}", why)

    def _env(self, args: str) -> Any:
        if not args:
            return dict(os.environ)
        key, sep, value = args.partition("=")
        if not sep:
            key, _, value = args.partition(" ")
            if not value:
                return os.environ.get(key)
        os.environ[key.strip()] = value.strip()
        return None

    def cell_magic(self, name: str, args: str, body: str) -> None:
        if name == "writefile":
            words = shlex.split(args)
            append = "-a" in words or "--append" in words
            target = Path(self.expand([w for w in words if not w.startswith("-")][-1]))
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "a" if append else "w") as fh:
                fh.write(body)
            print(f"{'Appending to' if append else 'Writing'} {target}")
        elif name in ("bash", "sh") or (name == "script" and args.strip() in ("bash", "sh")):
            sys.stdout.flush()
            subprocess.run(["/bin/bash", "-c", self.expand(body)], check=False)
        elif name in ("time", "timeit", "capture"):
            start = time.perf_counter()
            run_source(body, self.ns, f"<cell {self.cell}>")
            if name != "capture":
                print(f"Wall time: {time.perf_counter() - start:.3f} s")
        else:
            self.note(f"%%{name} {args}", "a cell magic disttrain does not run; the cell was not run")


def transform(source: str) -> tuple[str | None, str | None, str]:
    """A cell's Python: (cell magic name or None, its arguments, the Python or the magic's body)."""
    if source.lstrip().startswith("%%"):
        first, _, body = source.lstrip().partition("\n")
        name, _, args = first[2:].partition(" ")
        return name, args, body
    lines = []
    for line in source.split("\n"):
        m = _LINE_MAGIC.match(line)
        if not m or (m.group(3) == "%" and m.group(4)):
            lines.append(line)
            continue
        indent, target, kind, _, rest = m.groups()
        if kind == "%" and not rest[:1].isalpha():
            lines.append(line)  # a continued expression's modulo, not a magic
            continue
        assign = f"{target} = " if target else ""
        if kind == "!":
            call = f"_disttrain_ipython.{'getoutput' if target else 'system'}({rest!r})"
        else:
            name, _, args = rest.partition(" ")
            call = f"_disttrain_ipython.magic({name!r}, {args!r})"
        lines.append(f"{indent}{assign}{call}")
    return None, None, "\n".join(lines)


def display(*objs: Any, **kwargs: Any) -> None:
    """The kernel's ``display``: each object as Jupyter's text view shows it (a DataFrame's table)."""
    for obj in objs:
        print(obj.to_string() if hasattr(obj, "to_string") and callable(obj.to_string) else repr(obj))


def builtins_for(shell: Shell) -> dict[str, Any]:
    """What every Jupyter kernel puts in a notebook's namespace without an import."""
    return {"display": display, "get_ipython": lambda: shell, "_disttrain_ipython": shell}


def run_source(source: str, namespace: dict[str, Any], filename: str) -> None:
    """Run a cell as Jupyter does: its statements, then its last expression's value shown."""
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - the notebook's own code
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)  # noqa: S307
        if value is not None:
            print(repr(value))
            namespace["_"] = value


_CALL_ERROR = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\.__init__)?\(\) (got|takes|missing)")


def _sdk_classes() -> set[str]:
    return {name for module_name, module in list(sys.modules.items())
            if module_name.startswith("disttrain.sagemaker") and module is not None
            for name, value in vars(module).items() if isinstance(value, type)}


def _sdk_error(err: BaseException) -> bool:
    """Raised by disttrain's SDK surface on bad input (not by the notebook's own code): a
    DisttrainError, an error raised inside disttrain.sagemaker, or a call of one of its classes
    with an unknown or missing argument."""
    if isinstance(err, DisttrainError):
        return True
    if not isinstance(err, (TypeError, ValueError)):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    if frames and f"{os.sep}disttrain{os.sep}sagemaker{os.sep}" in frames[-1].filename:
        return True
    m = _CALL_ERROR.match(str(err))
    return isinstance(err, TypeError) and m is not None and m.group(1) in _sdk_classes()


def _where(err: BaseException, filename_prefix: str) -> str:
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if frame.filename.startswith(filename_prefix):
            return f"{frame.filename.strip('<>')}, line {frame.lineno}"
    return filename_prefix.strip("<>")


def run_notebook(path: Path, cells: list[Cell], say) -> int:
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": str(path)}
    shell = Shell(namespace, say)
    namespace.update(builtins_for(shell))
    os.chdir(path.parent)  # Jupyter starts the kernel in the notebook's folder
    for cell in cells:
        shell.cell = cell.number
        filename = f"<cell {cell.number}>"
        try:
            magic, magic_args, body = transform(cell.source)
            if magic is not None:
                shell.cell_magic(magic, magic_args or "", body)
            elif body.strip():
                run_source(body, namespace, filename)
        except SyntaxError as err:
            raise UsageError(f"{path.name} cell {cell.number}, line {err.lineno}: SyntaxError: {err.msg}") from None
        except BaseException as err:  # noqa: B036 - the notebook's error, reported as Jupyter would
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            if _sdk_error(err):
                where = _where(err, "<cell ")
                raise _OneLine(f"{path.name} {where}: {type(err).__name__}: {err}",
                               err.exit_code if isinstance(err, DisttrainError) else 1) from None
            print(f"disttrain: {path.name} cell {cell.number} raised; the cells after it were not run",
                  file=sys.stderr)
            traceback.print_exception(type(err), err, err.__traceback__)
            return 1
    return 0


class _OneLine(DisttrainError):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_script(path: Path, args: list[str]) -> int:
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException as err:  # noqa: B036 - reported as python would, or in one line
        if isinstance(err, KeyboardInterrupt):
            raise
        if _sdk_error(err):
            raise _OneLine(f"{_where(err, str(path))}: {type(err).__name__}: {err}",
                           err.exit_code if isinstance(err, DisttrainError) else 1) from None
        traceback.print_exception(type(err), err, err.__traceback__)
        return 1
    return 0


def run(file: str, args: list[str], say=None) -> int:
    """Run ``file`` (``.py`` or ``.ipynb``) with ``sagemaker`` served by disttrain; its exit code."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    path = Path(file)
    if not path.is_file():
        raise UsageError(f"{file}: no such file (give a .py script or a .ipynb notebook)")
    if path.suffix not in (".py", ".ipynb"):
        raise UsageError(f"{file}: expected a .py script or a .ipynb notebook")
    path = path.resolve()
    cells = read_notebook(path) if path.suffix == ".ipynb" else []  # a broken notebook: one line, nothing run
    sdkshim.install(say=say)
    saved_argv, saved_path, saved_cwd = sys.argv[:], sys.path[:], os.getcwd()
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    try:
        if path.suffix == ".ipynb":
            return run_notebook(path, cells, say)
        return run_script(path, args)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        sdkshim.uninstall()
