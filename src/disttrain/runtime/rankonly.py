"""Finding a collective called from code that only some ranks run.

``if ctx.is_main: print(meter.avg)`` reads a value reduced over every rank on rank 0
alone: the other ranks never join the all-reduce, and the job hangs (or, when they are in
another collective, breaks). Nothing at run time tells such a call from the first rank of
a correct one; its source does. :func:`rank_condition` looks at the caller's line and the
lines that called it: inside an ``if``/``while``/``and``/``or``/conditional expression that
tests the rank (``is_main``, ``rank``, ``get_rank()``, ``os.environ["RANK"]``...), or after
``if <rank test>: return``/``continue``/``break``, the call runs on some ranks only.

A heuristic: the same call in the other branch (``if ctx.is_main: ... else: ...``) counts as
every rank calling it, and a rank test it cannot see (a flag computed elsewhere) is a miss,
which the store check of ``MeanMeter.avg`` and ``barrier()`` (:func:`.metrics.every_rank`)
catches later. Each call site is judged once.
"""

from __future__ import annotations

import ast
import itertools
import linecache
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path
from types import CodeType, FrameType

# Names whose value differs by rank: reading one in a test makes the branch rank-only.
RANK_NAMES = frozenset({
    "is_main", "is_main_process", "is_local_main_process", "is_global_zero", "is_master",
    "rank", "local_rank", "global_rank", "node_rank", "group_rank", "get_rank",
    "get_local_rank", "RANK", "LOCAL_RANK", "GROUP_RANK",
})
_SKIPPED = (str(Path(__file__).resolve().parent.parent),
            *{sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)
# (code object, instruction) -> the rank test guarding it, or None: a call site is judged
# once, and every later call from it costs a dictionary lookup per frame.
_seen: dict[tuple[CodeType, int], str | None] = {}


def rank_condition(frame: FrameType | None) -> tuple[str, int, str] | None:
    """``(file, line, test)`` of the rank test that guards ``frame``'s current line or one
    of its callers' lines, or None when none is seen."""
    while frame is not None:
        key = (frame.f_code, frame.f_lasti)
        found = _seen.get(key, _UNSEEN)
        if found is _UNSEEN:
            filename = frame.f_code.co_filename
            found = None if filename.startswith(_SKIPPED) else _guard(filename, frame.f_lineno, *_columns(frame))
            _seen[key] = found
        if found is not None:
            return frame.f_code.co_filename, frame.f_lineno, found
        frame = frame.f_back
    return None


_UNSEEN = object()


def _columns(frame: FrameType) -> tuple[int, int]:
    """The column span of the frame's current instruction (Python >= 3.11), else the line."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is None or frame.f_lasti < 0:
        return -1, -1
    where = next(itertools.islice(positions(), frame.f_lasti // 2, None), None)
    if where is None or where[2] is None or where[3] is None:
        return -1, -1
    return where[2], where[3]


@lru_cache(maxsize=1024)
def _guard(filename: str, line: int, start: int, end: int) -> str | None:
    tree = _parse(filename)
    if tree is None:
        return None
    path = _path_to(tree, line, start, end)
    called = _called_name(path[-1])
    for parent, child in zip(path, path[1:]):
        test = _guarding_test(parent, child)
        if test is not None and _mentions_rank(test) and called not in _names_in(_other_branch(parent, child)):
            return _source(filename, test)
        for earlier in _earlier_siblings(parent, child):
            if isinstance(earlier, ast.If) and _mentions_rank(earlier.test) and earlier.body \
                    and isinstance(earlier.body[-1], _EXITS):
                return f"not ({_source(filename, earlier.test)})"
    return None


@lru_cache(maxsize=64)
def _parse(filename: str) -> ast.AST | None:
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        return ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return None


def _path_to(tree: ast.AST, line: int, start: int, end: int) -> list[ast.AST]:
    """The nodes from ``tree`` down to the innermost one spanning the position."""
    path = [tree]
    while True:
        inner = next((child for child in ast.iter_child_nodes(path[-1]) if _spans(child, line, start, end)), None)
        if inner is None:
            return path
        path.append(inner)


def _spans(node: ast.AST, line: int, start: int, end: int) -> bool:
    first, last = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
    if first is None or last is None or not first <= line <= last:
        return False
    if start < 0:
        return True
    if first == line and node.col_offset > start:
        return False
    return not (last == line and node.end_col_offset < end)


def _guarding_test(parent: ast.AST, child: ast.AST) -> ast.AST | None:
    """The test that decides whether ``child`` (a part of ``parent``) runs."""
    if isinstance(parent, (ast.If, ast.While, ast.IfExp)) and child is not parent.test:
        return parent.test
    if isinstance(parent, ast.BoolOp) and child is not parent.values[0]:
        before = parent.values[: parent.values.index(child)]
        return ast.BoolOp(op=parent.op, values=before) if len(before) > 1 else before[0]
    return None


def _called_name(node: ast.AST) -> str | None:
    """The name the frame is calling or reading at its position (``avg`` of ``meter.avg``)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _other_branch(parent: ast.AST, child: ast.AST) -> list[ast.AST]:
    """What runs instead of ``child`` when ``parent``'s test goes the other way: the same
    call there (``if ctx.is_main: a = meter.avg`` / ``else: b = meter.avg``) is every
    rank calling it."""
    if isinstance(parent, ast.If):
        return parent.orelse if child in parent.body else parent.body
    if isinstance(parent, ast.IfExp):
        return [parent.orelse if child is parent.body else parent.body]
    return []


def _names_in(nodes: list[ast.AST]) -> set[str]:
    found = set()
    for tree in nodes:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                found.add(node.attr)
            elif isinstance(node, ast.Name):
                found.add(node.id)
    return found


def _earlier_siblings(parent: ast.AST, child: ast.AST) -> list[ast.stmt]:
    for field in ("body", "orelse", "finalbody", "handlers"):
        statements = getattr(parent, field, None)
        if isinstance(statements, list) and child in statements:
            return statements[: statements.index(child)]
    return []


def _mentions_rank(test: ast.AST) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Name) and node.id in RANK_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr in RANK_NAMES:
            return True
        if isinstance(node, ast.Constant) and node.value in ("RANK", "LOCAL_RANK"):
            return True
    return False


def _source(filename: str, node: ast.AST) -> str:
    segment = ast.get_source_segment("".join(linecache.getlines(filename)), node) if hasattr(node, "lineno") \
        else None
    return " ".join((segment or ast.unparse(node)).split())[:80]


def caller_outside_disttrain() -> FrameType | None:
    """The first frame of the call stack outside disttrain's own code."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED[0]):
        frame = frame.f_back
    return frame
