"""Train a tiny causal language model with sequence-parallel (ring) attention, and check it.

Run with::

    torchrun --nproc-per-node 2 examples/ring_train.py            # gloo on CPU
    torchrun --nproc-per-node 4 examples/ring_train.py --layout contiguous --dtype float64

Each rank holds a shard of every sequence (tokens, positions, targets). Everything in the model
but attention works per token, so it runs on the shard unchanged; attention runs through
``attnkit.distributed.ContextParallelAttention``. The parameters are replicated: after each
backward ``sync_grads`` sums their gradients over the ranks, and every rank takes the same step.

Rank 0 also trains an identical copy of the model on the full sequences in one process, and the
script prints both losses at every step and exits non-zero if they differ beyond rounding.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import attnkit
from attnkit.distributed import ContextParallelAttention, shard, sync_grads


class Block(nn.Module):
    """Pre-norm transformer block; ``attend(attn, x)`` decides how attention runs."""

    def __init__(self, dim: int, heads: int, kv_heads: int, dtype) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, dtype=dtype)
        self.attn = attnkit.MultiHeadAttention(dim, heads, num_kv_heads=kv_heads, dtype=dtype)
        self.norm2 = nn.LayerNorm(dim, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, dtype=dtype), nn.GELU(),
                                 nn.Linear(4 * dim, dim, dtype=dtype))

    def forward(self, x, attend):
        x = x + attend(self.attn, self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, layers: int, max_len: int, dtype):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, dtype=dtype)
        self.pos = nn.Embedding(max_len, dim, dtype=dtype)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, dtype) for _ in range(layers))
        self.norm = nn.LayerNorm(dim, dtype=dtype)
        self.head = nn.Linear(dim, vocab, dtype=dtype)

    def forward(self, tokens, positions, attend):
        x = self.tok(tokens) + self.pos(positions)  # (B, L, dim); positions are global
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))  # (B, L, vocab)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=67, help="global sequence length (odd on purpose)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo")  # torchrun provides the rendezvous in the environment
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # same weights and data on every rank
    vocab, length = 97, args.seq_len
    model = TinyLM(vocab, dim=32, heads=4, kv_heads=2, layers=2, max_len=length, dtype=dtype)
    reference = copy.deepcopy(model) if rank == 0 else None
    data = torch.randint(vocab, (args.batch, length + 1))
    tokens, targets = data[:, :-1], data[:, 1:]
    positions = torch.arange(length).expand(args.batch, -1)

    # This rank's shard of every per-token tensor, in the layout attention expects.
    my_tokens, my_targets, my_positions = (shard(t, 1, layout=args.layout) for t in (tokens, targets, positions))
    ring = {id(b.attn): ContextParallelAttention(b.attn, layout=args.layout) for b in model.blocks}

    def ring_attend(attn, x):
        return ring[id(attn)](x, is_causal=True)

    def full_attend(attn, x):
        return attn(x, is_causal=True)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2) if rank == 0 else None
    n_tokens = tokens.numel()
    ok = True
    for step in range(args.steps):
        logits = model(my_tokens, my_positions, ring_attend)
        # Each rank's share of the mean loss over all tokens: the shares add up to the loss.
        loss = F.cross_entropy(logits.reshape(-1, vocab), my_targets.reshape(-1), reduction="sum")
        loss = loss / n_tokens
        opt.zero_grad()
        loss.backward()
        sync_grads(model)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)

        if rank == 0:
            ref_logits = reference(tokens, positions, full_attend)
            ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab), targets.reshape(-1))
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            a, b = total.item(), ref_loss.item()
            tol = 1e-5 if dtype == torch.float32 else 1e-10
            same = abs(a - b) <= tol * max(1.0, abs(b))
            ok &= same
            print(f"step {step}: loss ring ({world} ranks, {args.layout}) {a:.10f}   "
                  f"single process {b:.10f}   diff {abs(a - b):.2e}{'' if same else '   MISMATCH'}", flush=True)

    flag = torch.tensor([int(ok)])
    dist.broadcast(flag, src=0)
    if rank == 0:
        print("losses match the single-process run" if ok else "losses DIFFER from the single-process run")
    dist.barrier()  # nobody tears the links down while a peer still uses them
    dist.destroy_process_group()
    return 0 if int(flag) else 1


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalisation: gloo's C++ worker threads can still be alive while
    # Python tears down, and about one run in fifteen then dies in std::terminate (SIGABRT) after
    # every result was printed (see pytorch/pytorch#179291). All work is done and flushed here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
