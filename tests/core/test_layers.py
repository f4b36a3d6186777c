"""The layers point down: the core (the call, the mask plan, masks, scores, dtypes, the closure walker)
never imports a backend, and no attnkit module imports another that imports it back.

Both read the source (every ``import`` statement, module level or inside a function, except those under
``if TYPE_CHECKING:``), so a deferred import cannot hide a circle; and the core is imported for real in a
fresh process where ``attnkit.backends`` cannot be imported at all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "attnkit"

#: The core: what a call is and what it means; the backends build on it.
CORE = ("attnkit.call", "attnkit.masks", "attnkit.scores", "attnkit.positional", "attnkit.intervals",
        "attnkit.memory", "attnkit.dtypes", "attnkit.closures", "attnkit.per_element", "attnkit.ops",
        "attnkit.nonfinite", "attnkit.maskplan")


def modules() -> dict[str, Path]:
    """Every module of attnkit by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The attnkit modules ``name`` imports, wherever in the file (not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import sub` imports the submodule, `from mod import f` the module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_a_circle_through_a_deferred_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    source = ast.parse("def f():\n    from .b import g\n")  # a function-level import is an edge too
    assert isinstance(source.body[0].body[0], ast.ImportFrom)


def test_the_walker_finds_the_imports_it_should():
    edges = graph()
    assert "attnkit.maskplan.plan" in edges["attnkit.maskplan.plan_cache"]  # from .plan import MaskPlan
    assert "attnkit.masks" in edges["attnkit.maskplan.plan"]  # from .. import masks as _masks
    assert "attnkit.call" in edges["attnkit.backends.band"]


def test_no_import_circle_among_attnkit_modules():
    found = cycles(graph())
    assert not found, f"import circles (module-level or deferred imports): {found}"


def test_the_core_never_imports_a_backend():
    edges = graph()
    core = [m for m in edges if any(m == c or m.startswith(c + ".") for c in CORE)]
    assert len(core) > len(CORE)  # the maskplan and ops packages' modules are in
    reach = {}
    for start in core:  # everything a core module imports, directly or through others
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        reach[start] = sorted(m for m in seen if m.startswith("attnkit.backends"))
    bad = {m: r for m, r in reach.items() if r}
    assert not bad, f"core modules that import backends: {bad}"


def test_the_core_imports_with_backends_made_unimportable():
    names = sorted(m for m in modules() if any(m == c or m.startswith(c + ".") for c in CORE))
    script = (
        "import importlib, sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'attnkit.backends' or name.startswith('attnkit.backends.'):\n"
        "            raise ImportError('backends are not importable here: ' + name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print('imported', len(" + repr(names) + "))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(names)}" in done.stdout
