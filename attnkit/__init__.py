"""attnkit: self-attention that is correct, fast and inspectable.

The table of contents:

* ``attnkit.attention`` - the one entry point for the maths (``functional.py``), in front of
  ``attnkit.backends`` (decode, sdpa, band, fused_tiles, tiles, reference, flex; each a kernel with a name).
* ``attnkit.masks`` - mask predicates and builders, ``True`` = may attend.
* ``attnkit.mask_plan`` -> ``attnkit.MaskPlan`` - a mask worked out once for every kernel (``maskplan/``).
* ``attnkit.MultiHeadAttention`` - the module (``modules/``), and ``attnkit.cache.KVCache``, the key/value
  cache it decodes with.
* ``attnkit.ops`` - numerical primitives (safe softmax, tile forward/backward with log-sum-exp).
* ``positional``, ``scores``, ``models``, ``viz``, ``analysis``, ``distributed``, ``bench``.

Everything loads on first use, torch included: ``import attnkit`` is instant, so the command
line answers a mistyped argument before it pays for importing torch.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from . import backends, masks
    from .functional import attention, which_backend
    from .maskplan import MaskPlan, mask_plan
    from .modules import MultiHeadAttention

__version__ = "0.1.0"
"""The version of attnkit, as ``pip`` and ``attnkit --version`` show it."""

__all__ = ["MaskPlan", "MultiHeadAttention", "attention", "backends", "mask_plan", "masks", "which_backend",
           "__version__"]

#: Public names that live in a submodule: name -> the submodule that defines it.
_FROM = {"attention": "functional", "which_backend": "functional", "MultiHeadAttention": "modules",
         "MaskPlan": "maskplan", "mask_plan": "maskplan"}
_SUBMODULES = {"backends", "masks", "functional", "positional", "scores", "models", "viz", "analysis",
               "distributed", "bench", "modules", "ops", "cache", "approx", "maskplan", "intervals"}


def __getattr__(name: str):
    if name in _FROM:
        value = getattr(_importlib.import_module(f".{_FROM[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = _importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | _SUBMODULES)
