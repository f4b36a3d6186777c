"""``attnkit.attention``: the single entry point for the maths."""

from __future__ import annotations

from torch import Tensor

from . import backends, nonfinite
from .backends import Backend
from .call import Call, validate_call


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask=None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    mask_mod=None,
    score_mod=None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
):
    """Scaled dot-product attention, ``softmax(q k^T * scale + bias) v`` (Vaswani et al. 2017).

    Shape notation: ``...`` batch dims, ``H``/``Hkv`` query/key-value heads (``H % Hkv == 0``
    gives grouped- and multi-query attention), ``Lq``/``Lk`` lengths, ``E``/``Ev`` head sizes.

    Args:
        query: ``[..., H, Lq, E]``.
        key: ``[..., Hkv, Lk, E]``.
        value: ``[..., Hkv, Lk, Ev]``.
        mask: bool, ``True`` = may attend, broadcastable to ``[..., H, Lq, Lk]``; or a
            :class:`attnkit.MaskPlan` (:func:`attnkit.mask_plan`): a mask worked out once and
            reused across calls, layers and steps.
        bias: float, added to the scaled scores, broadcastable to ``[..., H, Lq, Lk]``.
        is_causal: look-ahead masking. With ``Lq != Lk`` it is aligned *bottom-right*: query
            ``i`` sits at position ``Lk - Lq + i`` (a KV cache's layout). PyTorch's SDPA aligns
            top-left; attnkit converts.
        window: ``(left, right)``: query at position ``p`` sees keys ``p - left ... p + right``
            (``None`` = unbounded on that side), aligned like ``is_causal``.
        mask_mod: ``fn(b, h, q_idx, kv_idx) -> bool``, FlexAttention's signature (4-D inputs).
        score_mod: ``fn(score, b, h, q_idx, kv_idx) -> score`` applied after scale and bias.
        scale: defaults to ``1 / sqrt(E)``, which keeps the score variance near 1.
        dropout_p: dropout on the attention probabilities; ``0`` in evaluation.
        return_weights: also return the probabilities ``[..., H, Lq, Lk]`` (before dropout).
        backend: ``"auto"`` or a name from ``attnkit.backends.available()``.

    Returns:
        ``out [..., H, Lq, Ev]``, or ``(out, weights)`` with ``return_weights=True``. A query row
        with no key to attend gives zeros (and zero weights and gradients), never NaN. A NaN or an
        infinity in the inputs makes exactly the rows that see it NaN, on every backend, and leaves
        every other row as it would be without it: the rule, forward and backward, is in
        :mod:`attnkit.nonfinite`.

    Raises:
        TypeError, ValueError: bad input, naming the argument, what came and what was expected
            (a ``mask_mod``/``score_mod`` is called once on a few in-range indices to check what it
            returns); a forced ``backend`` that cannot serve the call, with its reasons; a dense
            path (the weights, the reference backend) whose ``[..., H, Lq, Lk]`` tensors would
            exceed the memory available, or ``ATTNKIT_MAX_DENSE_BYTES`` when set.

    Plain PyTorch, for a reader::

        s = q @ k.transpose(-2, -1) * scale + bias
        out = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v
    """
    if (mask is None and bias is None and window is None and mask_mod is None and score_mod is None
            and return_weights is False and type(backend) is str and backend == "auto"
            and (type(dropout_p) is float or type(dropout_p) is int) and dropout_p == 0):
        leader = backends.registry.step_leader()  # a plain step's lane: the decode backend's, where it leads
        lane = getattr(leader, "step", None)
        out = None if lane is None else lane(query, key, value, is_causal, scale)
        if out is not None:
            backends.registry.note_served(leader)
            return out
    req, chosen = checked(query, key, value, mask=mask, bias=bias, is_causal=is_causal, window=window,
                          mask_mod=mask_mod, score_mod=score_mod, scale=scale, dropout_p=dropout_p,
                          return_weights=return_weights, backend=backend)
    out, weights = run(req, chosen)
    return (out, weights) if return_weights else out


def which_backend(query: Tensor, key: Tensor, value: Tensor, *, backend: str = "auto", **kwargs) -> str:
    """The name of the backend ``attention`` would run for these arguments (nothing is computed; whether its
    dense tensors would fit in memory is not asked)."""
    return backends.select(validate_call(query, key, value, **kwargs), backend).name


def checked(query: Tensor, key: Tensor, value: Tensor, *, backend: str = "auto", **kwargs) -> tuple[Call, Backend]:
    """:func:`attention`'s first half: its arguments validated and its backend chosen, nothing computed. Every
    error of a call is raised here, so a caller that changes state for a call (a KV cache's write) runs this
    first, then the change, then :func:`run`. That includes the memory error of the backend chosen, when it forms
    dense tensors (its ``check_fits``: :mod:`attnkit.backends.refusals`)."""
    req = validate_call(query, key, value, **kwargs)
    chosen = backends.select(req, backend)
    fits = getattr(chosen, "check_fits", None)
    if fits is not None:
        fits(req)
    return req, chosen


def run(req: Call, chosen: Backend) -> tuple[Tensor, Tensor | None]:
    """:func:`attention`'s second half: ``chosen`` serves ``req`` under the NaN rule (:mod:`attnkit.nonfinite`)."""
    backends.registry.note_served(chosen)
    return nonfinite.call(chosen, req)
