"""What code needs while torch.compile or torch.export traces it: a way back to real tensors."""

from __future__ import annotations

import contextlib

from torch import Tensor


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
