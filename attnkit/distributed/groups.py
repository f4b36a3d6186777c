"""Process groups: this rank's place in one, and where a collective's bookkeeping tensors live."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def group_info(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group`` (the default group when ``None``).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("attnkit.distributed needs an initialised process group: call "
                           "torch.distributed.init_process_group(...) first (or launch with torchrun)")
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(x, group=None) -> torch.device:
    """Where small bookkeeping tensors for a collective live: NCCL needs them on the GPU.

    ``x`` is the caller's tensor, or whatever a caller whose arguments were refused got instead.
    """
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    if isinstance(x, Tensor) and x.is_cuda:
        return x.device
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
