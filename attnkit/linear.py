"""Kernel (linearised) attention; it lives in :mod:`attnkit.approx.kernel`, re-exported here.

``attnkit.linear`` keeps its earlier import path; :func:`attnkit.approx.attention` serves the
same maps by name (``kind="elu"``, ``"relu"``, ``"performer"``) with attnkit's mask arguments.
"""

from __future__ import annotations

from .approx.kernel import elu_feature_map, linear_attention, random_feature_map, relu_feature_map

__all__ = ["elu_feature_map", "relu_feature_map", "random_feature_map", "linear_attention"]
