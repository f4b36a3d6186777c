"""The list of tasks and the lookup that imports one on first use, so that naming the tasks (the
command line does, to check ``attnkit train TASK``) imports no torch."""

from __future__ import annotations

import importlib
from types import ModuleType

TASKS = ("vit", "caption", "translate", "classify", "recommend", "lm", "recall", "graph", "forecast", "tag")
"""The tasks, each a module ``attnkit.apps.<task>``, in the order ``attnkit train --help`` lists them."""


def task(name: str) -> ModuleType:
    """The module of task ``name`` (imported now).

    Raises:
        ValueError: ``name`` is not one of :data:`TASKS`.
    """
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
    return importlib.import_module(f"{__package__}.{name}")
