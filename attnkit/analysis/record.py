"""Recording what a model's own forward pass attends with, without changing the model.

* :func:`recorded_weights` - each call's attention weights.
* :func:`recorded_qk` - each call's queries and keys as the attention takes them (after the rotary
  transform), whose ``q @ k^T * scale`` are its scores: what the viewer's score-terms panel shows.

Usage::

    with recorded_weights(layer.cross_attn for layer in model.decoder.layers) as rec:
        model.generate(...)
    weights = [torch.cat(calls, dim=2) for calls in rec]   # per module: [B, H, Lq, Lk]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from torch import Tensor, nn


@contextmanager
def recorded_weights(modules: Iterable[nn.Module]) -> Iterator[list[list[Tensor]]]:
    """Inside the block, each :class:`attnkit.modules.MultiHeadAttention` in ``modules`` also keeps
    its attention weights.

    Yields:
        One list per module, appended to on each of its calls with the weights ``[B, H, Lq, Lk]``
        (detached); with a KV cache each decoding step adds ``Lq = 1``.

    A pre-hook asks each module for its weights (``need_weights=True``) and a hook takes them off
    the output again, so the caller sees the output it always does: the weights come from the very
    forward pass, computed by the backend that returns them (the reference), so outputs equal the
    usual ones up to rounding. The hooks are removed when the block ends, also on an error.

    Raises:
        TypeError: a module that is not an attnkit ``MultiHeadAttention``.
    """
    from ..modules import MultiHeadAttention

    modules = list(modules)
    for m in modules:
        if not isinstance(m, MultiHeadAttention):
            raise TypeError(f"modules must be attnkit.modules.MultiHeadAttention, got {type(m).__name__}")
    records: list[list[Tensor]] = [[] for _ in modules]
    caller_asked: dict[int, bool] = {}  # a caller that asked for the weights itself keeps them

    def ask(module, args, kwargs):
        caller_asked[id(module)] = bool(kwargs.get("need_weights", False))
        return args, {**kwargs, "need_weights": True}

    def keep(calls: list[Tensor]):
        def hook(module, args, kwargs, output):
            out, weights = output
            calls.append(weights.detach())
            return output if caller_asked.pop(id(module)) else out
        return hook

    handles = []
    try:
        for m, calls in zip(modules, records, strict=True):
            handles.append(m.register_forward_pre_hook(ask, with_kwargs=True))
            handles.append(m.register_forward_hook(keep(calls), with_kwargs=True))
        yield records
    finally:
        for h in handles:
            h.remove()


class ScoreInputs(NamedTuple):
    """One call's queries and keys as its attention took them: ``q @ k^T * scale`` are its scores,
    before masks, biases, position biases and score mods are added."""

    q: Tensor  #: ``[B, H, Lq, D]``, after the rotary transform (if any)
    k: Tensor  #: ``[B, Hkv, Lk, D]``, after the rotary transform; with a KV cache, every cached key
    scale: float  #: the module's ``scale``, or ``1 / sqrt(D)`` as :func:`attnkit.attention` uses


@contextmanager
def recorded_qk(modules: Iterable[nn.Module]) -> Iterator[list[list[ScoreInputs]]]:
    """Inside the block, each :class:`attnkit.modules.MultiHeadAttention` in ``modules`` also keeps
    the queries and keys its attention scores, so that a score can be taken apart by dimension
    (:func:`attnkit.analysis.score_terms`, the viewer's ``qk=``).

    Yields:
        One list per module, appended to on each of its calls with a :class:`ScoreInputs`
        ``(q, k, scale)`` (detached copies); with a KV cache each decoding step adds ``Lq = 1``
        and every key cached so far.

    Each module hands them over itself, as its attention takes them (after the rotary transform;
    with a cache, the written keys), through its ``score_inputs_sinks``: the output is not touched and
    nothing is computed twice. Use it beside :func:`recorded_weights` to keep both from one pass.
    The sinks are removed when the block ends, also on an error.

    Raises:
        TypeError: a module that is not an attnkit ``MultiHeadAttention``.
        ValueError: a module set to an approximate method (``kind``): its weights are not a
            softmax of these scores.
    """
    from ..modules import MultiHeadAttention

    modules = list(modules)
    for m in modules:
        if not isinstance(m, MultiHeadAttention):
            raise TypeError(f"modules must be attnkit.modules.MultiHeadAttention, got {type(m).__name__}")
        if m.approx is not None:
            raise ValueError(f"modules must run exact attention (kind=None) to record q and k, got a module "
                             f"with kind {m.approx.kind!r}, whose weights are not a softmax of q . k")
    records: list[list[ScoreInputs]] = [[] for _ in modules]

    def keep(module, calls: list[ScoreInputs]):
        def sink(q: Tensor, k: Tensor) -> None:
            scale = module.scale if module.scale is not None else 1.0 / math.sqrt(q.shape[-1])
            calls.append(ScoreInputs(q.detach().clone(), k.detach().clone(), float(scale)))
        return sink

    added = []
    try:
        for m, calls in zip(modules, records, strict=True):
            sink = keep(m, calls)
            m.score_inputs_sinks.append(sink)
            added.append((m, sink))
        yield records
    finally:
        for m, sink in added:
            m.score_inputs_sinks.remove(sink)
