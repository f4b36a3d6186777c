"""``attnkit bench gpu``: attnkit on a CUDA device against the engines it stands on.

For each mask family (causal, a causal sliding window, packed documents, causal with ALiBi) and each
length, in bfloat16, forward and forward+backward, in one run:

* ``attnkit.attention`` as ``backend="auto"`` chooses on CUDA (the table names the backend);
* compiled ``flex_attention`` with the ``BlockMask`` of its own ``create_block_mask`` (the same kernel
  attnkit's ``flex`` backend runs, with attnkit's BlockMask made from its mask plan instead);
* SDPA's flash kernel, for causal;
* the time to work the mask out: ``attnkit.mask_plan`` and the ``BlockMask`` made from it, against
  ``create_block_mask``, compiled and warm.

Every timing is the median of CUDA-synchronised runs after a warm-up call (which compiles). Without
a CUDA device the command stops with one line saying so.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import attention, mask_plan, masks, scores, which_backend
from ..backends import flex as flex_backend
from ..call import validate_call
from ._util import markdown_table, progress, write_report

SIZES = (4096, 8192, 16384, 32768)
QUICK_SIZES = (4096,)
B, H, D = 1, 16, 128
DTYPE = torch.bfloat16
WINDOW = 1024
ROUNDS = 10
QUICK_ROUNDS = 3


def _cuda_time(fn, rounds: int) -> float:
    """Median seconds of ``fn()`` over ``rounds`` runs, each synchronised, after one warm-up run."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _documents(n: int) -> torch.Tensor:
    """Document ids ``[n]``: packed documents of lengths drawn between n/16 and n/4 (seeded)."""
    g = torch.Generator().manual_seed(0)
    ids, doc, at = torch.empty(n, dtype=torch.long), 0, 0
    while at < n:
        length = int(torch.randint(n // 16, n // 4 + 1, (1,), generator=g))
        ids[at:at + length] = doc
        at, doc = at + length, doc + 1
    return ids.cuda()


def _cases(n: int) -> dict:
    """name -> (attnkit keyword arguments, Flex mask_mod, Flex score_mod or None)."""
    docs = _documents(n)
    slopes = scores.alibi_slopes(H, device="cuda")

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)

    def documents(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return {
        "causal": ({"is_causal": True}, causal, None),
        f"window {WINDOW}, causal": ({"window": (WINDOW, 0)}, window, None),
        "documents, causal": ({"is_causal": True, "mask_mod": masks.document_mod(docs)}, documents, None),
        "ALiBi, causal": ({"is_causal": True, "score_mod": scores.alibi(slopes)}, causal, alibi),
    }


def _step(fn, q, k, v, backward: bool):
    """One forward (no_grad), or forward and backward of a fixed output gradient."""
    if not backward:
        def forward():
            with torch.no_grad():
                fn(q, k, v)
        return forward
    dout = torch.randn_like(q)

    def both():
        out = fn(q, k, v)
        out.backward(dout)
        q.grad = k.grad = v.grad = None
    return both


def _measure(n: int, rounds: int, say) -> list[list]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    make_block_mask = torch.compile(create_block_mask)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_() for _ in range(3))
    rows = []
    for name, (kw, mask_mod, score_mod) in _cases(n).items():
        say(f"{name}, n = {n}")
        block_mask = make_block_mask(mask_mod, None, None, n, n, device="cuda")
        plan_s = _cuda_time(lambda kw=kw: _attnkit_block_mask(q, k, v, kw), rounds)
        cbm_s = _cuda_time(lambda mask_mod=mask_mod: make_block_mask(mask_mod, None, None, n, n, device="cuda"),
                           rounds)
        chosen = which_backend(q, k, v, **kw)
        for backward in (False, True):
            ours = _cuda_time(_step(lambda a, b, c, kw=kw: attention(a, b, c, **kw), q, k, v, backward),
                              rounds)
            theirs = _cuda_time(_step(lambda a, b, c, bm=block_mask, sm=score_mod: flex(a, b, c, score_mod=sm,
                                                                                       block_mask=bm),
                                      q, k, v, backward), rounds)
            sdpa = "-"
            if name == "causal":
                def flash(a, b, c):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(a, b, c, is_causal=True)
                sdpa = _cuda_time(_step(flash, q, k, v, backward), rounds) * 1e3
            rows.append([name, n, "fwd+bwd" if backward else "fwd", chosen, ours * 1e3, theirs * 1e3,
                         f"{theirs / ours:.2f}x", sdpa, plan_s * 1e3, cbm_s * 1e3, f"{cbm_s / plan_s:.1f}x"])
    return rows


def _attnkit_block_mask(q, k, v, kw: dict):
    """The mask worked out from scratch: a new ``attnkit.mask_plan`` and the flex backend's BlockMask from it."""
    plan = mask_plan(kw.get("mask_mod"), q_len=q.shape[-2], is_causal=kw.get("is_causal", False),
                     window=kw.get("window"), device=q.device)
    with torch.no_grad():
        return flex_backend._inputs(validate_call(q, k, v, mask=plan), flex_backend.BLOCK_SIZE).args[4]


def run(quick: bool, out_dir: Path) -> str:
    """Measure, write ``out_dir/gpu.md`` and return the table.

    Raises:
        ValueError: no CUDA device (one line: the command needs one).
    """
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device: attnkit bench gpu measures attnkit on a CUDA GPU "
                         "(torch.cuda.is_available() is False here)")
    say = progress("gpu")
    rows = []
    for n in QUICK_SIZES if quick else SIZES:
        rows += _measure(n, QUICK_ROUNDS if quick else ROUNDS, say)
    header = ["mask", "n", "pass", "attnkit backend", "attnkit (ms)", "Flex + create_block_mask (ms)",
              "attnkit speed / Flex's", "SDPA flash (ms)", "attnkit plan + BlockMask (ms)",
              "create_block_mask, compiled (ms)", "plan speed / create_block_mask's"]
    body = (f"{torch.cuda.get_device_name()}, B = {B}, H = {H}, head dim {D}, bfloat16. Medians of CUDA-synchronised "
            "runs after a warm-up call. \"attnkit speed / Flex's\" is Flex's time over attnkit's (above 1: attnkit "
            "is faster); the plan columns time the mask worked out from scratch: a new attnkit.mask_plan and the "
            "flex backend's BlockMask from it, against create_block_mask.\n\n"
            + markdown_table(header, rows))
    return write_report(out_dir, "gpu", "attnkit on a CUDA GPU", body,
                        "attnkit bench gpu" + (" --quick" if quick else ""))
