"""Ring attention on a CUDA device: each block through compiled Flex with its log-sum-exp, gradients through
Flex's backward of the block given the merged statistics.

Skipped without CUDA. A one-rank group (NCCL) runs the ring's own code on one GPU: a block, its merge and
its backward, against the reference backend in float64 on the CPU. Several ranks on CPU tensors are
``tests/distributed/test_ring.py``'s, which runs this Flex path through Flex's eager maths too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import attnkit
from attnkit import masks, scores
from attnkit.distributed import ring_attention
from tests.support.tolerances import close

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    store = tmp_path_factory.mktemp("ring") / "store"
    backend = "nccl" if dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


CASES = {
    "causal": {"is_causal": True},
    "window and documents": {"window": (40, 8), "mask_mod": masks.document_mod(torch.arange(300) // 70)},
    "ALiBi, capped": {"is_causal": True, "score_mod": scores.compose(scores.alibi(scores.alibi_slopes(4)),
                                                                      scores.softcap(20.0))},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_ring_of_one_gpu_goes_through_flex_and_matches_the_reference(one_rank, case):
    kw = CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, n, 300, 64, generator=g, dtype=torch.float64) for n in (4, 2, 2, 4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attnkit.attention(*ref_in, backend="reference", **kw)
    want.backward(dout)
    cuda_kw = {n: (masks.document_mod(torch.arange(300, device="cuda") // 70) if n == "mask_mod" else x)
               for n, x in kw.items()}
    mine = [t.float().cuda().requires_grad_() for t in (q, k, v)]
    from attnkit.backends import flex
    served = []
    with_lse = flex.attention_with_lse
    flex.attention_with_lse = lambda req, **a: served.append(1) or with_lse(req, **a)
    try:
        out = ring_attention(*mine, **cuda_kw)
        out.backward(dout.float().cuda())
    finally:
        flex.attention_with_lse = with_lse
    assert len(served) == 2, "the forward and the backward each go through Flex"
    close(out.cpu(), want, torch.float32)
    for got, ref in zip(mine, ref_in, strict=True):
        close(got.grad.cpu(), ref.grad, torch.float32)
