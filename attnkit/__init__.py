"""attnkit: self-attention that is correct, fast and inspectable.

The table of contents:

* ``attnkit.attention`` - the one entry point for the maths (``functional.py``), in front of
  ``attnkit.backends`` (reference, sdpa, blockwise, ...).
* ``attnkit.masks`` - mask predicates and builders, ``True`` = may attend.
* ``attnkit.MultiHeadAttention`` - the module (``modules/``).
* ``attnkit.ops`` - numerical primitives (safe softmax, tile forward/backward with log-sum-exp).
* Heavier parts load on first use: ``positional``, ``scores``, ``models``, ``viz``,
  ``analysis``, ``distributed``, ``bench``.
"""

from __future__ import annotations

import importlib

from . import backends, masks
from .functional import attention, which_backend
from .modules import MultiHeadAttention

__version__ = "0.1.0"

__all__ = ["MultiHeadAttention", "attention", "backends", "masks", "which_backend", "__version__"]

_LAZY = {"positional", "scores", "models", "viz", "analysis", "distributed", "bench", "modules", "ops",
         "cache", "linear"}


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
