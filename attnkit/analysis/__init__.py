"""Reading attention maps and costing attention.

* :func:`rollout` - attention rollout (Abnar & Zuidema 2020) with residual term and head fusion.
* :func:`entropy`, :func:`mean_distance` - per-head summaries of attention maps.
* :func:`attention_cost`, :func:`projection_params` - a complexity calculator (FLOPs, score-matrix
  memory, parameter counts), including the single- versus multi-head comparison that a widely copied
  count gets wrong (1,032,192 parameters for d = 512 and 8 heads, where the total is 1,048,576).
"""

from __future__ import annotations

from .complexity import AttentionCost, attention_cost, compare_heads, projection_params
from .heads import entropy, mean_distance
from .rollout import fuse_heads, rollout

__all__ = [
    "AttentionCost",
    "attention_cost",
    "compare_heads",
    "entropy",
    "fuse_heads",
    "mean_distance",
    "projection_params",
    "rollout",
]
