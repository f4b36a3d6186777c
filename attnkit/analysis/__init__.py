"""Reading attention maps and costing attention.

* :func:`rollout` - attention rollout (Abnar & Zuidema 2020) with residual term and head fusion.
* :func:`entropy`, :func:`mean_distance` - per-head summaries of attention maps.
* :func:`recorded_weights` - the weights of a model's own forward pass, kept by hooks.
* :func:`recorded_qk` - the queries and keys each attention call took (after positions), kept by hooks.
* :func:`score_terms` - a score ``q . k * scale`` taken apart into its per-dimension terms.
* :func:`attention_cost`, :func:`projection_params` - a complexity calculator (FLOPs, score-matrix
  memory, parameter counts), including the single- versus multi-head comparison that a widely copied
  count gets wrong (1,032,192 parameters for d = 512 and 8 heads, where the total is 1,048,576).
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from .complexity import AttentionCost, attention_cost, compare_heads, projection_params
    from .heads import entropy, mean_distance
    from .record import recorded_qk, recorded_weights
    from .rollout import fuse_heads, rollout
    from .terms import score_terms

__all__ = [
    "AttentionCost",
    "attention_cost",
    "compare_heads",
    "entropy",
    "fuse_heads",
    "mean_distance",
    "projection_params",
    "recorded_qk",
    "recorded_weights",
    "rollout",
    "score_terms",
]

#: Each name's submodule: loaded on first use, so the complexity calculator (pure arithmetic)
#: does not import torch, which ``heads`` and ``rollout`` need.
_FROM = {"AttentionCost": "complexity", "attention_cost": "complexity", "compare_heads": "complexity",
         "projection_params": "complexity", "entropy": "heads", "mean_distance": "heads",
         "fuse_heads": "rollout", "rollout": "rollout", "recorded_weights": "record",
         "recorded_qk": "record", "score_terms": "terms"}


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module 'attnkit.analysis' has no attribute {name!r}")
    module = _importlib.import_module(f".{_FROM[name]}", __name__)
    # Bind all of the submodule's names at once: importing ``.rollout`` sets the package's
    # ``rollout`` attribute to the module, which must not shadow the function of that name.
    globals().update({n: getattr(module, n) for n, m in _FROM.items() if m == _FROM[name]})
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(__all__)
