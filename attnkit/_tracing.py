"""What code needs while torch.compile or torch.export traces it: a way back to real tensors."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TypeVar

from torch import Tensor

_F = TypeVar("_F", bound=Callable)


def assume_constant_result(fn: _F) -> _F:
    """:func:`torch.compiler.assume_constant_result` without importing ``torch._dynamo`` (seconds of
    start-up that every process using attnkit would pay, compiling or not): the decorator only marks
    the function (``_dynamo_marked_constant``), which is what torch 2.5-2.13 do; tests check that the
    mark is still torch's and that compiled calls still treat these functions as constants."""
    if "torch._dynamo" in sys.modules:  # already paid for: torch's own decorator
        import torch

        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@contextlib.contextmanager
def real_tensors():
    """Real tensors inside, even while torch.compile or torch.export traces the caller (whose fake
    tensors cannot be compared with a formula or decide anything): for one-time checks and
    decisions (the kernels' self-checks, whether a mod broadcasts)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


def is_fake(t: Tensor) -> bool:
    """Whether ``t`` is a tracing placeholder (made inside the code being traced), not real data."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t)
