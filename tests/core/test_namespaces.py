"""Every package's namespace holds only what its ``__all__`` promises, plus its own submodules.

A helper imported for internal use (``importlib``, ``Tensor``, a check function) that is not
underscored becomes a name users can reach, complete in an editor and start to rely on; this keeps
``dir(package)`` the map of its public API. The packages are found by walking the tree, so a new
package is checked without being listed here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import types

import pytest

import attnkit

PACKAGES = ["attnkit"] + sorted(m.name for m in pkgutil.walk_packages(attnkit.__path__, "attnkit.") if m.ispkg)


def test_the_walk_finds_the_packages():
    """Guards the walk: if it stopped descending, the test below would check only ``attnkit``."""
    assert {"attnkit.backends", "attnkit.cli", "attnkit.integrations", "attnkit.maskplan"} <= set(PACKAGES)


@pytest.mark.parametrize("name", PACKAGES)
def test_public_names_are_the_promised_ones_or_submodules(name):
    package = importlib.import_module(name)
    assert "__all__" in vars(package), f"{name} has no __all__"
    promised = package.__all__
    assert len(promised) == len(set(promised)), f"{name}.__all__ lists a name twice: {promised}"
    unresolved = [n for n in promised if not hasattr(package, n)]
    assert not unresolved, f"{name}.__all__ lists names it does not have: {unresolved}"
    # After the lazy names above are resolved, so that what resolving them binds is checked too.
    leaked = sorted(n for n, value in vars(package).items()
                    if not n.startswith("_") and n not in promised
                    and not (isinstance(value, types.ModuleType) and value.__name__ == f"{name}.{n}"))
    assert not leaked, (f"{name} has public names outside its __all__ that are not its submodules: {leaked}; "
                        "list them in __all__ or import them under a leading underscore")


def test_the_package_docstring_names_every_registered_backend():
    names = re.search(r"``attnkit.backends`` \(([^)]*)\)", attnkit.__doc__.replace("\n", " ")).group(1)
    assert set(re.findall(r"\w+", names.split(";")[0])) == set(attnkit.backends.available())


def test_the_architecture_page_lists_every_registered_backend():
    """The call flow's "run the kernel" list: one line per backend ``which_backend`` can name, each once."""
    from tests.support.markdown_blocks import ROOT

    page = (ROOT / "docs" / "contributing" / "architecture.md").read_text(encoding="utf-8")
    kernels = page.split("run the kernel:", 1)[1].split("```", 1)[0]
    listed = re.findall(r"^ {8}(\w+) {2,}\S", kernels, flags=re.MULTILINE)
    assert sorted(listed) == sorted(attnkit.backends.available())
