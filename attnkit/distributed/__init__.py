"""Sequence (context) parallel attention over ``torch.distributed``: ring attention and sharding.

* :func:`ring_attention` - exact attention over query/key/value sharded along the sequence,
  forward and backward, with ``attnkit.attention``'s arguments: causal, sliding window and any
  ``mask_mod`` (padding, documents, sparse patterns) on global positions, GQA and ``Lq != Lk``;
  works with gloo (CPU) and NCCL (GPU) and the process group you give it.
* :func:`shard` / :func:`unshard` - split a full sequence into this rank's shard and gather it
  back, in the ``"contiguous"`` or load-balanced ``"zigzag"`` layout.
* :class:`ContextParallelAttention` - a ``MultiHeadAttention`` run sequence-parallel;
  :func:`sync_grads` sums replicated parameter gradients over the group.
"""

from .context_parallel import ContextParallelAttention, sync_grads
from .ring import ring_attention
from .shard import LAYOUTS, shard, shard_positions, shard_sizes, unshard

__all__ = [
    "LAYOUTS",
    "ContextParallelAttention",
    "ring_attention",
    "shard",
    "shard_positions",
    "shard_sizes",
    "sync_grads",
    "unshard",
]
