"""Approximate and alternative attention, side by side, with one calling convention.

``attnkit.attention`` is exact and never routes here: an approximation is something you ask for
by name. Every kind takes ``[..., H, L, E]`` like ``attnkit.attention`` and returns
``[..., H, Lq, Ev]``; each honours exactly the masks in :data:`SUPPORTS` and refuses the rest:

* ``elu``, ``relu``: kernel attention with ``phi = elu + 1`` or ``relu`` (Katharopoulos et al.
  2020); arguments ``chunk_size``, ``eps``; masks: key-padding, ``is_causal``; :func:`step` decodes.
* ``performer``: FAVOR+ with positive orthogonal random features (Choromanski et al. 2021);
  ``num_features`` and ``seed``, or a fixed ``projection``; ``chunk_size`` (also non-causal: features
  are built ``chunk_size`` tokens at a time, in linear time); masks: key-padding, ``is_causal``.
* ``nystrom``: Nystromformer, segment-mean landmarks (Xiong et al. 2021); ``num_landmarks``,
  ``exact_pinv``, ``pinv_iterations``; masks: key-padding.
* ``linformer``: learned sequence projections (Wang et al. 2020); ``projection``
  (:class:`LinformerProjection`); masks: none.
* ``dot``: the unscaled dot-product score ``q . k``; masks: all.
* ``multiplicative``: Luong's ``q^T W k``; ``weight``; masks: all.
* ``additive``: Bahdanau's ``w . tanh(W_q q + W_k k)``; ``score_vector``, ``query_weight``,
  ``key_weight``; masks: all.

A key-padding mask is a bool ``mask`` that does not vary over queries (size 1 in its
``Lq`` dimension, e.g. ``[B, 1, 1, Lk]``). :class:`ApproxAttention` holds each kind's parameters
for :class:`attnkit.MultiHeadAttention` (``kind=``).
"""

from .dispatch import KINDS, SUPPORTS, attention, kind_arguments, step
from .kernel import (
    LinearState,
    elu_feature_map,
    favor_feature_map,
    linear_attention,
    orthogonal_features,
    random_feature_map,
    relu_feature_map,
)
from .linformer import LinformerProjection
from .module import ApproxAttention

__all__ = ["attention", "step", "KINDS", "SUPPORTS", "kind_arguments", "LinearState", "LinformerProjection",
           "ApproxAttention", "linear_attention", "elu_feature_map", "relu_feature_map", "random_feature_map",
           "orthogonal_features", "favor_feature_map"]
