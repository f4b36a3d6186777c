"""The API reference, generated from each package's ``__all__`` and the docstrings.

One page per public module (:data:`MODULES`): the module's docstring, then every name its
``__all__`` lists (for a module without ``__all__``, the classes and functions it defines), each
rendered by mkdocstrings from the object's own definition under the name users import it by
(``attnkit.attention``, not ``attnkit.functional.attention``).

A public name without a docstring fails the build here, and ``tests/docs/test_docs.py`` runs the same
check (:func:`missing_docstrings`) in the test suite, where the docs extra is not installed: this
file uses the standard library and attnkit only. A docstring is what mkdocstrings shows: a class's
or function's own ``__doc__``, a module's, and for a constant the string literal on the line after
its assignment (an attribute docstring).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

#: Where the generated pages go, inside the site.
SECTION = "api"

#: The public modules, in the order of the reference, each with a line saying what it is for.
MODULES = {
    "attnkit": "The entry point (`attention`, `which_backend`), the mask plan (`mask_plan`, `MaskPlan`), the module.",
    "attnkit.masks": "Mask predicates (`*_mod`) and dense builders; `True` = may attend.",
    "attnkit.maskplan": "The mask plan: a mask worked out once into each row's intervals, how, and the plan cache.",
    "attnkit.intervals": "Interval algebra: each row's allowed keys as sorted, disjoint `[start, end)` pairs.",
    "attnkit.scores": "Score mods: ALiBi, relative-position tables, soft-capping, and their typed forms.",
    "attnkit.positional": "Positional schemes: sinusoidal, learned, RoPE, ALiBi, T5 buckets, Shaw.",
    "attnkit.modules": "`MultiHeadAttention` and the Transformer blocks.",
    "attnkit.cache": "The static KV cache for decoding.",
    "attnkit.nonfinite": "The NaN/inf rule every backend keeps, forward and backward, and the check that keeps it.",
    "attnkit.backends": "The backend registry behind `attnkit.attention`.",
    "attnkit.ops": "Numerical primitives: a safe masked softmax, tiles with log-sum-exp.",
    "attnkit.models": "BERT, its tokenizer and GPT-2, built from attnkit's modules.",
    "attnkit.integrations.transformers": "attnkit as a Hugging Face transformers attention implementation.",
    "attnkit.approx": "Approximate and alternative attention, asked for by name.",
    "attnkit.distributed": "Ring (sequence-parallel) attention and its sharding helpers.",
    "attnkit.distributed.local": "Run a function on a few gloo ranks on this machine.",
    "attnkit.viz": "Heat maps and the offline HTML viewer.",
    "attnkit.analysis": "Rollout, entropy per head, recorded weights, the cost calculator.",
    "attnkit.lab": "Claims about attention, tested by experiments.",
    "attnkit.apps": "Applications that train here.",
}

#: Modules of ``attnkit`` that have no page of their own, and why.
NO_PAGE = {
    "attnkit.functional": "its public names are attnkit.attention and attnkit.which_backend",
    "attnkit.bench": "programs that `attnkit bench` runs, documented under Benchmarks",
}


def page_name(module: str) -> str:
    """The page of a module, inside the API section: ``attnkit.masks`` -> ``masks.md``."""
    return ("index-attnkit" if module == "attnkit" else module.removeprefix("attnkit.")) + ".md"


def public_names(module: str) -> list[str]:
    """What ``module`` offers: its ``__all__``, else the classes and functions defined in it."""
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(mod).items()
            if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
            and getattr(v, "__module__", None) == module]


def where(module: str, name: str) -> tuple[str, object]:
    """``(the path mkdocstrings renders, the object)``: a class or function at its definition, a
    module as itself, a constant as its package exports it (mkdocstrings follows the import)."""
    obj = getattr(importlib.import_module(module), name)
    if inspect.ismodule(obj):
        return obj.__name__, obj
    if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "").startswith("attnkit"):
        return f"{obj.__module__}.{obj.__qualname__}", obj
    return f"{module}.{name}", obj


def _attribute_docstring(module: str, name: str) -> str | None:
    """The string literal after ``name = ...`` in ``module`` or in the module it imports ``name`` from."""
    mod = importlib.import_module(module)
    path = getattr(mod, "__file__", None)
    if not path:
        return None
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    body = tree.body
    for i, node in enumerate(body):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            nxt = body[i + 1] if i + 1 < len(body) else None
            if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                return nxt.value.value
            return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname in (None, name) for a in node.names):
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), mod.__package__ or module) \
                if node.level else node.module
            if source and source.startswith("attnkit") and source != module:
                return _attribute_docstring(source, name)
    return None


def docstring(module: str, name: str) -> str | None:
    """The docstring mkdocstrings would show for ``module.name``, or None."""
    _, obj = where(module, name)
    if inspect.ismodule(obj) or inspect.isfunction(obj) or inspect.ismethod(obj):
        return inspect.cleandoc(obj.__doc__) if obj.__doc__ else None
    if inspect.isclass(obj):
        own = vars(obj).get("__doc__")
        return inspect.cleandoc(own) if isinstance(own, str) and own.strip() else None
    return _attribute_docstring(module, name)


def missing_docstrings() -> list[str]:
    """Every public name, module included, whose docstring is missing or blank."""
    missing = []
    for module in MODULES:
        mod = importlib.import_module(module)
        if not (mod.__doc__ or "").strip():
            missing.append(module)
        missing += [f"{module}.{n}" for n in public_names(module) if not (docstring(module, n) or "").strip()]
    return missing


def unlisted_modules() -> list[str]:
    """Submodules ``attnkit`` offers by name that have neither a page nor a reason in :data:`NO_PAGE`."""
    import attnkit

    offered = {f"attnkit.{n}" for n in attnkit._SUBMODULES}
    return sorted(offered - set(MODULES) - set(NO_PAGE))


def home(path: str) -> str:
    """The module whose page renders the object at ``path`` in full: of the modules that export it,
    the one its definition lies in (the longest prefix of ``path``), else the first listed. The
    others link to it, so each object has one anchor."""
    homes = [m for m in MODULES for n in public_names(m) if where(m, n)[0] == path]
    inside = [m for m in homes if path.startswith(m + ".")]
    return max(inside, key=len) if inside else homes[0]


def page(module: str) -> str:
    """The reference page of one module."""
    lines = [f"# `{module}`", "", MODULES[module], "",
             f"::: {module}", "    options:", "      members: false", "      show_root_heading: false",
             "      show_root_toc_entry: false", ""]
    for name in public_names(module):
        path, obj = where(module, name)
        public = f"{module}.{name}"
        if inspect.ismodule(obj):
            lines += [f"## `{public}`", "", f"A module: see [`{obj.__name__}`]({page_name(obj.__name__)}).", ""]
            continue
        if home(path) != module:
            first = f"{home(path)}.{name}"
            lines += [f"## `{public}`", "", f"The same object as [`{first}`]({page_name(home(path))}#{path}).", ""]
            continue
        lines += [f"::: {path}", "    options:", "      heading_level: 2", "      show_root_heading: true",
                  "      show_root_full_path: true"]
        if path != public:
            lines += [f'      heading: "{public}"', f'      toc_label: "{name}"']
        lines.append("")
    return "\n".join(lines)


def index_page() -> str:
    """The API section's first page: every module with its line."""
    rows = "\n".join(f"| [`{m}`]({page_name(m)}) | {what} |" for m, what in MODULES.items())
    return f"""# API reference

Generated from the code: every name in each package's `__all__` (for a module without one, the
classes and functions it defines), with its docstring. Shapes use the notation of
`attnkit.attention`: `...` batch dimensions, `H`/`Hkv` query and key-value heads, `Lq`/`Lk`
lengths, `E`/`Ev` head sizes. The guides say how the pieces fit together; this is what each one
takes, returns and raises.

| module | what it holds |
|---|---|
{rows}
"""


# --- MkDocs hook -------------------------------------------------------------------------------


def on_config(config):
    """Fail on an undocumented public name; expand ``API reference: api/index.md`` into its pages."""
    from mkdocs.exceptions import PluginError

    missing = missing_docstrings()
    if missing:
        raise PluginError("public names without a docstring (the API reference shows each one's): "
                          + ", ".join(missing))
    unlisted = unlisted_modules()
    if unlisted:
        raise PluginError(f"modules offered by attnkit with no API page: {unlisted}; add them to MODULES or "
                          "NO_PAGE in docs/_hooks/api.py")
    for i, entry in enumerate(config.nav or []):
        if isinstance(entry, dict) and entry.get("API reference") == f"{SECTION}/index.md":
            config.nav[i] = {"API reference": [f"{SECTION}/index.md"] +
                             [{m: f"{SECTION}/{page_name(m)}"} for m in MODULES]}
    return config


def on_files(files, config):
    """Add the generated pages."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, f"{SECTION}/index.md", content=index_page()))
    for module in MODULES:
        files.append(File.generated(config, f"{SECTION}/{page_name(module)}", content=page(module)))
    return files
