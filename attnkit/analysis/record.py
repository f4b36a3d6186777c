"""Recording the attention weights of a model's own forward pass, without changing the model.

Usage::

    with recorded_weights(layer.cross_attn for layer in model.decoder.layers) as rec:
        model.generate(...)
    weights = [torch.cat(calls, dim=2) for calls in rec]   # per module: [B, H, Lq, Lk]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

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
