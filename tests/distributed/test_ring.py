"""Ring attention on real gloo process groups (CPU, loopback) against single-process attention.

Spawning a group costs seconds, so each test runs a whole grid of cases in one group, and tests whose
grids can run one after another share a group (a module fixture; each test reads its part); a worker
collects the cases that disagree and the test fails listing them. Every comparison takes this
rank's rows of the single-process result (``attnkit.attention`` on the full sequences) and the
rank's shard of its gradients; ``unshard`` must give back the full tensors too.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.distributed as dist

import attnkit
from attnkit import masks
from attnkit.distributed import (
    ContextParallelAttention,
    ring_attention,
    shard,
    shard_positions,
    shard_sizes,
    sync_grads,
    unshard,
)
from attnkit.distributed import ring as ring_module
from attnkit.distributed.local import RankError, run_local
from tests.support.tolerances import close

pytestmark = pytest.mark.distributed

SPAWN_TIMEOUT = 60.0  # seconds for one group: spawn, rendezvous, every case
SHARED_TIMEOUT = 150.0  # the 2-rank group the three comparison grids share: all three, one after another


# --------------------------------------------------------------------------------------------
# The case grid and the per-rank worker
# --------------------------------------------------------------------------------------------


def _case(layout, *, lq=13, lk=13, heads=4, kv_heads=2, dv=6, is_causal=False, window=None, lengths=None,
          mod=None, dtype=torch.float64, batch=2):
    return dict(layout=layout, lq=lq, lk=lk, heads=heads, kv_heads=kv_heads, dv=dv, is_causal=is_causal,
                window=window, lengths=lengths, mod=mod, dtype=dtype, batch=batch)


def _mask_mod(c):
    """The case's mask_mod on global positions: padding, or one of the named predicates."""
    if c["lengths"] is not None:
        return masks.padding_mod(torch.tensor(c["lengths"]))
    if c["mod"] == "documents":  # packed documents of 1 to 5 tokens, the same ids for queries and keys
        ids = torch.arange(max(c["lq"], c["lk"])) // 5 + (torch.arange(max(c["lq"], c["lk"])) % 7 == 3).cumsum(0)
        return masks.document_mod(ids[:c["lq"]] if c["lq"] == c["lk"] else ids[-c["lq"]:], ids[:c["lk"]])
    if c["mod"] == "user":  # a plain function: several intervals per row, derived by evaluating it
        return lambda b, h, q_idx, kv_idx: ((q_idx + kv_idx) % 3 != 1) | (b == 1)
    if c["mod"] == "heads":  # depends on the head: no interval form, the tiles path
        return lambda b, h, q_idx, kv_idx: (kv_idx + h) % 2 == 0
    return None


def _grid(layouts=("contiguous", "zigzag")) -> list[dict]:
    """causal / non-causal / window / padded, odd and unequal lengths, GQA and MHA, empty shards."""
    cases = []
    masking = [
        {},
        {"is_causal": True},
        {"window": (3, 1)},
        {"window": (2, 0), "is_causal": True},
        {"window": (None, 2)},
        {"lengths": [9, 0]},  # batch 1 has no real key: zero rows, zero grads
        {"lengths": [5, 13], "is_causal": True},
        {"mod": "documents"},
        {"mod": "user", "is_causal": True},
        {"mod": "heads", "window": (4, 4)},
    ]
    shapes = [
        {"lq": 13, "lk": 13},  # odd: shards of different lengths
        {"lq": 5, "lk": 12},  # Lq < Lk: bottom-right, queries late in the sequence
        {"lq": 11, "lk": 6, "kv_heads": 4},  # Lq > Lk: early causal rows see nothing
        {"lq": 3, "lk": 3, "kv_heads": 1},  # fewer positions than zigzag chunks: empty pieces, MQA
    ]
    for layout, m, s in itertools.product(layouts, masking, shapes):
        if "lengths" in m and s["lk"] != 13:
            m = dict(m, lengths=[min(n, s["lk"]) for n in m["lengths"]])
        cases.append(_case(layout, **s, **m))
    return cases


def _inputs(c, seed):
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, d = c["batch"], c["heads"], c["kv_heads"], 8
    q = torch.randn(b, h, c["lq"], d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, c["lk"], d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, c["lk"], c["dv"], generator=g, dtype=torch.float64)
    dout = torch.randn(b, h, c["lq"], c["dv"], generator=g, dtype=torch.float64)
    return [t.to(c["dtype"]) for t in (q, k, v, dout)]


def _describe(c) -> str:
    keys = ("layout", "lq", "lk", "heads", "kv_heads", "is_causal", "window", "lengths", "mod", "dtype")
    return ", ".join(f"{k}={c[k]}" for k in keys if c[k] not in (None, False))


def _compare_cases(rank, world, cases, group_ranks=None, tile=None):
    """Run every case through ring attention; return the failures, described.

    ``tile`` runs the tiles path (the banded kernel switched off) and shrinks the largest score
    tile a rank computes at once, so that a block splits into several tiles (and empty tiles
    inside a block are skipped) even at these small sizes.
    """
    group = None if group_ranks is None else _subgroup(rank, group_ranks)
    kernel_calls = []
    if tile is not None:
        ring_module._TILE = tile
        ring_module._band.available = lambda: False  # a spawned worker: nothing else runs in it
    elif ring_module._band.available():  # count the banded kernel's calls: the cases must reach it
        forward = ring_module._band.partial_forward
        ring_module._band.partial_forward = lambda *a: kernel_calls.append(1) or forward(*a)
    failures = []
    for i, c in enumerate(cases):
        q, k, v, dout = _inputs(c, seed=i)
        mask_mod = _mask_mod(c)
        # The reference runs in float64 on the same (rounded) inputs, so a low-precision case
        # measures the ring's own error, which must not grow with the number of ranks.
        ref_in = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
        ref = attnkit.attention(*ref_in, mask_mod=mask_mod, is_causal=c["is_causal"], window=c["window"],
                                backend="reference")
        ref.backward(dout.to(torch.float64))

        lay = c["layout"]
        mine = [shard(t, 2, layout=lay, group=group).detach().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, group=group, is_causal=c["is_causal"], window=c["window"], layout=lay,
                             mask_mod=mask_mod)
        out.backward(shard(dout, 2, layout=lay, group=group))
        got = {"out": out, "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
        want = {"out": ref, "dq": ref_in[0].grad, "dk": ref_in[1].grad, "dv": ref_in[2].grad}
        for name in got:
            for what, actual, expected in (
                ("shard", got[name], shard(want[name], 2, layout=lay, group=group)),
                ("unshard", unshard(got[name].detach(), 2, layout=lay, group=group), want[name]),
            ):
                try:
                    close(actual, expected, dtype=c["dtype"])
                except AssertionError as e:
                    first = str(e).splitlines()[:3]
                    failures.append(f"rank {rank} [{_describe(c)}, tile={ring_module._TILE}] {name} ({what}): "
                                    f"{' '.join(first)}")
    if tile is None and ring_module._band.available():
        ring_module._band.partial_forward = forward
        if not kernel_calls:
            failures.append(f"rank {rank}: the banded kernel is available but no case reached it")
    return failures


def _subgroup(rank, group_ranks):
    """Every rank creates every subgroup (new_group is a collective); return the one with ``rank``."""
    mine = None
    for ranks in group_ranks:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def _check(results):
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:20])


# --------------------------------------------------------------------------------------------
# Two ranks: the full grid, float64
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)  # the first of the three tests of the shared group: it waits for the group
def test_ring_matches_single_process_float64_2_ranks(two_rank_grids):
    _check(two_rank_grids["float64 grid"])


def _grid_twice(rank, world, cases):
    return _compare_cases(rank, world, cases) + _compare_cases(rank, world, cases, tile=4)


def _lower_precision_and_module(rank, world):
    failures = []
    cases = [_case(lay, is_causal=True, lengths=[11, 7], dtype=torch.float32) for lay in ("contiguous", "zigzag")]
    cases += [_case(lay, window=(4, 0), dtype=torch.float32, lq=9, lk=17) for lay in ("contiguous", "zigzag")]
    cases += [_case("zigzag", is_causal=True, dtype=torch.bfloat16, lq=16, lk=16)]
    failures += _compare_cases(rank, world, cases)
    failures += _module_case(rank, world)
    failures += _uneven_contiguous(rank, world)
    failures += _gradcheck_singleton(rank, world)
    return failures


def _module_case(rank, world):
    """ContextParallelAttention + sync_grads equal the module and its gradients on the full sequence."""
    failures = []
    for layout, kwargs in (("zigzag", {"is_causal": True}), ("contiguous", {"window": (3, 2)})):
        torch.manual_seed(0)
        mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64)
        x = torch.randn(2, 11, 16, dtype=torch.float64)
        lengths = torch.tensor([11, 6])
        mask = masks.padding(lengths, 11)[:, 0]  # [B, 1, Lk]
        ref = mha(x, mask=mask, **kwargs)
        ref.square().sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in mha.named_parameters()}
        mha.zero_grad()

        cp = ContextParallelAttention(mha, layout=layout)
        out = cp(shard(x, 1, layout=layout), mask_mod=masks.padding_mod(lengths), **kwargs)
        out.square().sum().backward()  # this rank's share of the same loss
        sync_grads(cp)
        try:
            close(out, shard(ref, 1, layout=layout))
            for n, p in mha.named_parameters():
                close(p.grad, ref_grads[n])
        except AssertionError as e:
            failures.append(f"rank {rank} module [{layout} {kwargs}]: {str(e).splitlines()[:3]}")
    return failures


def _uneven_contiguous(rank, world):
    """Contiguous shards of any lengths (here q 3 | 10, k/v 8 | 5), unshard and its gradient."""
    c = _case("contiguous", lq=13, lk=13, is_causal=True, window=(6, 0), lengths=[12, 13])
    q, k, v, dout = _inputs(c, seed=7)
    lengths = torch.tensor(c["lengths"])
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = attnkit.attention(*ref_in, mask=masks.padding(lengths, 13), is_causal=True, window=(6, 0))
    ref.backward(dout)
    q_rows = slice(0, 3) if rank == 0 else slice(3, 13)
    kv_rows = slice(0, 8) if rank == 0 else slice(8, 13)
    mine = [q[:, :, q_rows].clone().requires_grad_(), k[:, :, kv_rows].clone().requires_grad_(),
            v[:, :, kv_rows].clone().requires_grad_()]
    out = ring_attention(*mine, is_causal=True, window=(6, 0), mask_mod=masks.padding_mod(lengths))
    full = unshard(out, 2)  # differentiable: the same loss on every rank, each rank its rows
    (full * dout).sum().backward()
    failures = []
    for name, actual, expected in (("out", full, ref), ("dq", mine[0].grad, ref_in[0].grad[:, :, q_rows]),
                                   ("dk", mine[1].grad, ref_in[1].grad[:, :, kv_rows]),
                                   ("dv", mine[2].grad, ref_in[2].grad[:, :, kv_rows])):
        try:
            close(actual, expected)
        except AssertionError as e:
            failures.append(f"rank {rank} uneven contiguous {name}: {str(e).splitlines()[:3]}")
    return failures


def _gradcheck_singleton(rank, world):
    """gradcheck in float64 on a one-rank group (the other ranks' groups run at the same time)."""
    group = _subgroup(rank, [[r] for r in range(world)])
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v: ring_attention(q, k, v, group=group, is_causal=True,  # noqa: E731
                                        mask_mod=masks.padding_mod(torch.tensor([3])))
    ok = torch.autograd.gradcheck(fn, (q, k, v), raise_exception=False)
    return [] if ok else [f"rank {rank}: gradcheck failed on a one-rank group"]


@pytest.mark.timeout(180)
def test_ring_float32_bfloat16_module_and_gradcheck_2_ranks(two_rank_grids):
    _check(two_rank_grids["lower precision and module"])


def _score_mod_cases(rank, world):
    """Score biases and soft caps on global positions: outputs, input gradients and a learned table's
    gradient (summed over the ranks) against one process in float64; a score_mod the kernel cannot
    apply is refused on every rank."""
    from attnkit import scores

    g = torch.Generator().manual_seed(5)
    slopes = scores.alibi_slopes(4, dtype=torch.float64)
    table = torch.randn(4, 9, generator=g, dtype=torch.float64)

    def relative(score, b, h, q_idx, kv_idx):  # hand-written: a learned table, clipped distances
        return score + table[h, (kv_idx - q_idx).clamp(-4, 4) + 4]

    def capped(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    cases = [("zigzag", {"is_causal": True}, scores.alibi(slopes)),
             ("contiguous", {"window": (3, 2)}, relative),
             ("zigzag", {"is_causal": True}, capped),
             ("contiguous", {}, scores.compose(scores.alibi(slopes), scores.softcap(5.0)))]
    failures = []
    for i, (layout, kw, mod) in enumerate(cases):
        c = _case(layout, lq=13, lk=13)
        q, k, v, dout = _inputs(c, seed=20 + i)
        q, k, v = (t * 3 for t in (q, k, v))  # scores large enough for the caps to bite
        table.requires_grad_(mod is relative)
        ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
        ref = attnkit.attention(*ref_in, score_mod=mod, backend="reference", **kw)
        ref.backward(dout)
        want_table = None if table.grad is None else table.grad.clone()
        table.grad = None
        mine = [shard(t, 2, layout=layout).detach().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, layout=layout, score_mod=mod, **kw)
        out.backward(shard(dout, 2, layout=layout))
        got = {"out": (out, shard(ref, 2, layout=layout))}
        for name, mine_t, ref_t in zip(("dq", "dk", "dv"), mine, ref_in, strict=True):
            got[name] = (mine_t.grad, shard(ref_t.grad, 2, layout=layout))
        if want_table is not None:
            dist.all_reduce(table.grad)  # each rank holds its query rows' share
            got["table"] = (table.grad, want_table)
            table.grad = None
        for name, (actual, expected) in got.items():
            try:
                close(actual, expected)
            except AssertionError as e:
                failures.append(f"rank {rank} score_mod case {i} ({layout}, {kw}) {name}: {str(e).splitlines()[:3]}")
    q, k, v, _ = _inputs(_case("contiguous"), seed=1)
    try:
        ring_attention(*(shard(t, 2) for t in (q, k, v)), score_mod=lambda s, b, h, i, j: s * 2)
        failures.append(f"rank {rank}: a score_mod the kernel cannot apply was not refused")
    except ValueError as e:
        if "ring_attention serves a score_mod only as the banded kernel (CPU) or compiled Flex (CUDA)" not in str(e):
            failures.append(f"rank {rank}: unexpected refusal {e}")
    return failures


@pytest.mark.timeout(180)
def test_ring_score_biases_and_soft_caps_2_ranks(two_rank_grids):
    _check(two_rank_grids["score mods"])


def _three_grids(rank, world, cases):
    """The three 2-rank comparisons, each part's failures by name. The float64 grid comes last: its tiles pass
    switches the banded kernel off for the rest of the process, and the other two run on it."""
    return {"lower precision and module": _lower_precision_and_module(rank, world),
            "score mods": _score_mod_cases(rank, world),
            "float64 grid": _grid_twice(rank, world, cases)}


@pytest.fixture(scope="module")
def two_rank_grids():
    """The three 2-rank comparison grids in one group (a group costs seconds to spawn; each test reads its
    part): the float64 grid, lower precision with the module and gradcheck, and the score mods."""
    cases = _grid()
    assert len(cases) == 80
    results = run_local(_three_grids, 2, cases, timeout=SHARED_TIMEOUT)
    return {part: [per_rank[part] for per_rank in results] for part in results[0]}


# --------------------------------------------------------------------------------------------
# The Flex path (what CUDA tensors take), on the CPU
# --------------------------------------------------------------------------------------------


def _eager_flex(lse=False, dynamic=False):
    """Flex uncompiled in place of the compiled one: PyTorch refuses a CPU backward only at
    flex_attention's door (``_validate_device``), and its eager maths has one."""
    import torch.nn.attention.flex_attention as fa

    from attnkit.backends import flex as flex_module

    fa._validate_device = lambda *args: None
    # (eager flex_attention still traces itself; shapes kept static, as attnkit's own compile keeps them)
    torch._dynamo.config.automatic_dynamic_shapes = False
    return flex_module._flex_call(lse)


def _flex_path(rank, world):
    """Each block through Flex with its log-sum-exp, merged as the other paths merge theirs, and its
    gradients through Flex's backward of the block given the merged statistics: the grid's masks and
    layouts, GQA, dead rows, a learned relative table and a cap, against one process in float64, through
    Flex's eager maths (compiled Flex on the CPU has neither a backward nor the log-sum-exp); and a family
    that fails to compile, whose blocks the tiles path serves."""
    import warnings

    from attnkit import scores
    from attnkit.backends import flex as flex_module

    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    ring_module._FLEX_DEVICES = ("cpu",)
    ring_module._band.available = lambda: False  # a spawned worker: nothing else runs in it
    served = []
    with_lse = flex_module.attention_with_lse
    flex_module.attention_with_lse = lambda req, **kw: served.append(req.q_len) or with_lse(req, **kw)
    failures = []

    # a family compiled Flex cannot serve (a stand-in compile that fails): the tiles path serves its blocks, said
    # once; with a score_mod, which the tiles do not apply, the call raises naming the cause
    def no_compiler(lse=False, dynamic=False):
        def kernel(*args):
            raise RuntimeError("no C++ compiler found")
        return kernel

    flex_module._compile = no_compiler
    c = _case("zigzag", lq=16, lk=16, dtype=torch.float32, batch=1)
    q, k, v, _ = _inputs(c, seed=3)
    want = attnkit.attention(q.double(), k.double(), v.double(), is_causal=True, backend="reference")
    mine = [shard(t, 2, layout="zigzag") for t in (q, k, v)]
    out = ring_attention(*mine, layout="zigzag", is_causal=True)
    try:
        close(out, shard(want, 2, layout="zigzag"), dtype=torch.float32)
    except AssertionError as e:
        failures.append(f"rank {rank} a block compiled Flex cannot serve: {str(e).splitlines()[:3]}")
    if not served:
        failures.append(f"rank {rank}: the blocks did not try Flex")
    try:
        ring_attention(*mine, layout="zigzag", is_causal=True, score_mod=scores.alibi(scores.alibi_slopes(4)))
        failures.append(f"rank {rank}: a score_mod on blocks compiled Flex cannot serve was not refused")
    except RuntimeError as e:
        if "compiled flex_attention cannot serve a block (RuntimeError: no C++ compiler found)" not in str(e):
            failures.append(f"rank {rank}: unexpected error {e}")

    flex_module._compile = _eager_flex
    flex_module._families.clear()
    flex_module._failed.clear()
    masking = [{}, {"is_causal": True}, {"window": (3, 1)}, {"lengths": [9, 0]}, {"mod": "documents"},
               {"mod": "user", "is_causal": True}, {"mod": "heads", "window": (4, 4)}]
    shapes = (("zigzag", {"lq": 13, "lk": 13}), ("contiguous", {"lq": 5, "lk": 12}))  # Lq < Lk: bottom-right
    cases = [_case(shapes[i % 2][0], dtype=torch.float32, **m, **shapes[i % 2][1]) for i, m in enumerate(masking)]
    served.clear()
    failures += _compare_cases(rank, world, cases)
    if len(served) < len(cases):
        failures.append(f"rank {rank}: {len(served)} blocks through Flex for {len(cases)} cases")

    g = torch.Generator().manual_seed(5)
    table = torch.randn(4, 9, generator=g, dtype=torch.float64)
    table32 = table.float()
    slopes = scores.alibi_slopes(4, dtype=torch.float64)

    def relative(t):  # a learned table, clipped distances
        return lambda score, b, h, q_idx, kv_idx: score + t[h, (kv_idx - q_idx).clamp(-4, 4) + 4]

    c = _case("zigzag", lq=13, lk=13)
    for what, ref_mod, mod, learned, size in (
            ("a learned relative table", relative(table), relative(table32), (table, table32), 1),
            ("ALiBi then a cap", scores.compose(scores.alibi(slopes), scores.softcap(5.0)),
             scores.compose(scores.alibi(slopes.float()), scores.softcap(5.0)), None, 3)):  # scores the cap bites
        q, k, v, dout = (t * size for t in _inputs(c, seed=9))
        for t in learned or ():
            t.requires_grad_()
        ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
        want = attnkit.attention(*ref_in, score_mod=ref_mod, window=(3, 2), backend="reference")
        want.backward(dout)
        mine = [shard(t.float(), 2, layout="zigzag").detach().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, layout="zigzag", window=(3, 2), score_mod=mod)
        out.backward(shard(dout.float(), 2, layout="zigzag"))
        pairs = [("out", out, shard(want, 2, layout="zigzag"))]
        pairs += [(name, got.grad, shard(ref.grad, 2, layout="zigzag"))
                 for name, got, ref in zip(("dq", "dk", "dv"), mine, ref_in, strict=True)]
        if learned:
            dist.all_reduce(learned[1].grad)  # each rank holds its query rows' share
            pairs.append(("table", learned[1].grad, learned[0].grad))
        for name, actual, expected in pairs:
            try:
                close(actual, expected, dtype=torch.float32)
            except AssertionError as e:
                failures.append(f"rank {rank} {what} through Flex, {name}: {str(e).splitlines()[:4]}")
    return failures


@pytest.mark.timeout(150)
def test_ring_through_flex_with_its_log_sum_exp_2_ranks():
    # (its grid runs Flex's eager maths in every rank, in about 25 s on a quiet host and near a minute on a
    # loaded one: a group timeout of its own, with room)
    _check(run_local(_flex_path, 2, timeout=120.0))


# --------------------------------------------------------------------------------------------
# Four ranks, and rings on subgroups
# --------------------------------------------------------------------------------------------


def _four_ranks(rank, world, cases, ring_cases):
    failures = _compare_cases(rank, world, cases)
    # Then rings {0, 2} and {1, 3}: group ranks differ from global ranks, two rings run at once.
    failures += _compare_cases(rank, world, ring_cases, [[0, 2], [1, 3]])
    return failures + _compare_cases(rank, world, cases, tile=3)  # last: it switches the kernel off


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ring_matches_single_process_4_ranks_and_on_subgroups():
    cases = [c for c in _grid() if c["lq"] != 3 or c["layout"] == "zigzag"]
    cases += [_case("zigzag", is_causal=True, lengths=[11, 7], dtype=torch.float32, lq=29, lk=29),
              _case("contiguous", window=(4, 0), dtype=torch.float32, lq=9, lk=17)]
    ring_cases = [_case(lay, is_causal=True, lengths=[10, 13]) for lay in ("contiguous", "zigzag")]
    _check(run_local(_four_ranks, 4, cases, ring_cases, timeout=100.0))


# --------------------------------------------------------------------------------------------
# Failures are reported, not waited on
# --------------------------------------------------------------------------------------------


def _rank1_fails_mid_ring(rank, world):
    q = torch.randn(1, 2, 4 if rank == 0 else 3, 8)
    if rank == 1:
        ring_attention(q, q[:, :1], q[:, :1].float().to(torch.float64))  # v's dtype is wrong, on rank 1 only
    return ring_attention(q, q, q).sum().item()  # rank 0 waits for rank 1 in the ring


@pytest.mark.timeout(60)
def test_a_failing_rank_fails_the_run_with_its_error():
    with pytest.raises(RankError, match=r"rank 1 of 2 failed:(.|\n)*value dtype torch.float64 does not match query"):
        run_local(_rank1_fails_mid_ring, 2, timeout=40.0)


def _mismatched_zigzag(rank, world):
    q = torch.randn(1, 1, 4 - rank, 4)  # lengths 4 and 3: not the zigzag split of 7 (3, 4)
    return ring_attention(q, q, q, layout="zigzag").sum().item()


@pytest.mark.timeout(60)
def test_shards_that_are_not_the_zigzag_split_are_refused_on_every_rank():
    with pytest.raises(RankError, match=r"not the zigzag split of 7 positions, expected \[3, 4\]"):
        run_local(_mismatched_zigzag, 2, timeout=40.0)


# --------------------------------------------------------------------------------------------
# Ranks called differently: every rank raises, naming the rank and the argument
# --------------------------------------------------------------------------------------------

# (what differs, rank 0's call, rank 1's call, what rank 0 and rank 1 must raise). Without the check
# the first four computed wrong rows silently (with head sizes swapped every message still has the
# size its receiver expects), and a different dtype, heads or batch died inside gloo.
_REFUSED = re.escape("ring_attention: rank 1 refused its arguments")
_MISMATCHES = [
    ("head sizes swapped", {}, {"d": 6, "dv": 8}, "rank 1 has head_dim=6 but rank 0 has head_dim=8"),
    ("is_causal", {"is_causal": True}, {"is_causal": False},
     "rank 1 has is_causal=False but rank 0 has is_causal=True"),
    ("scale", {}, {"scale": 0.5}, "rank 1 has scale=0.5 but rank 0 has scale=0.35355339059327373"),
    ("window", {"window": (3, 1)}, {"window": (3, None)}, "rank 1 has window=(3, None) but rank 0 has window=(3, 1)"),
    ("dtype", {}, {"dtype": torch.float32}, "rank 1 has dtype=torch.float32 but rank 0 has dtype=torch.float64"),
    ("heads", {}, {"heads": 2}, "rank 1 has heads=2 but rank 0 has heads=4"),
    ("batch", {}, {"batch": 1}, "rank 1 has batch=1 but rank 0 has batch=2"),
    ("kv_heads", {}, {"kv_heads": 1}, "rank 1 has kv_heads=1 but rank 0 has kv_heads=2"),
    ("padding lengths", {"lengths": [9, 4]}, {"lengths": [9, 3]}, "rank 1 has mask_mod=a predicate with fingerprint"),
    ("mask_mod given", {"lengths": [9, 4]}, {}, "rank 1 has mask_mod=None but rank 0 has mask_mod=a predicate"),
    ("requires_grad", {"grad": True}, {}, "rank 1 has requires_grad=False but rank 0 has requires_grad=True"),
    # A rank that refuses its own arguments raises its own error; the other is not left waiting.
    ("refused", {}, {"window": (-1, 0)}, (_REFUSED, "window left must be None or a non-negative int")),
]


def _mismatched_calls(rank, world, cases):
    """Each case's call on this rank: the message it raised, or what it returned."""
    got = []
    for _, *calls, _ in cases:
        c = dict({"batch": 2, "heads": 4, "kv_heads": 2, "d": 8, "dv": 6, "dtype": torch.float64}, **calls[rank])
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(c["batch"], c["heads"], 5, c["d"], generator=g, dtype=c["dtype"])
        k = torch.randn(c["batch"], c["kv_heads"], 5, c["d"], generator=g, dtype=c["dtype"])
        v = torch.randn(c["batch"], c["kv_heads"], 5, c["dv"], generator=g, dtype=c["dtype"])
        q.requires_grad_(c.get("grad", False))
        lengths = None if "lengths" not in c else torch.tensor(c["lengths"])
        try:
            out = ring_attention(q, k, v, is_causal=c.get("is_causal", False), window=c.get("window"),
                                 scale=c.get("scale"), mask_mod=None if lengths is None else masks.padding_mod(lengths))
        except (TypeError, ValueError) as e:
            got.append(str(e))
        else:
            got.append(f"no error: returned {tuple(out.shape)}")
    # The module checks its inputs before it reaches ring attention; a rank refused there stops the others too.
    cp = ContextParallelAttention(attnkit.MultiHeadAttention(16, 4, dtype=torch.float64))
    try:
        cp(torch.randn(1, 3, 16 if rank == 0 else 12, dtype=torch.float64))
    except (TypeError, ValueError) as e:
        got.append(str(e))
    else:
        got.append("no error")
    # The group is still in step after all that: a call made alike on both ranks gives the right rows.
    q, k, v, _ = _inputs(_case("contiguous", lq=10, lk=10), seed=3)
    ref = attnkit.attention(q, k, v, is_causal=True, window=(3, 1), backend="reference")
    out = ring_attention(*(shard(t, 2) for t in (q, k, v)), is_causal=True, window=(3, 1))
    close(out, shard(ref, 2))
    return got


def _both_mismatch_grids(rank, world, calls, unshards):
    """ring_attention's mismatched calls, then unshard's, in one group (each grid ends checking the group is
    still in step)."""
    return {"ring_attention": _mismatched_calls(rank, world, calls),
            "unshard": _mismatched_unshards(rank, world, unshards)}


@pytest.fixture(scope="module")
def mismatched():
    """What each rank said to each mismatched call of both grids: one group for the two tests."""
    results = run_local(_both_mismatch_grids, 2, _MISMATCHES, _UNSHARD_MISMATCHES, timeout=60.0)
    return {part: [per_rank[part] for per_rank in results] for part in results[0]}


@pytest.mark.timeout(90)  # the first of the two tests of the shared group: it waits for the group
def test_ranks_called_differently_all_raise_naming_the_rank_and_argument(mismatched):
    """Every case on every rank, then ContextParallelAttention with rank 1's input refused by the module."""
    results = mismatched["ring_attention"]
    wrong = []
    for i, (what, _, _, want) in enumerate(_MISMATCHES):
        for rank in range(2):
            pattern = want[rank] if isinstance(want, tuple) else "ring_attention: " + re.escape(want)
            if not re.search(pattern, results[rank][i]):
                wrong.append(f"{what}: rank {rank} said {results[rank][i]!r}, expected /{pattern}/")
    for rank, pattern in enumerate((_REFUSED, re.escape("query must be [B, L_local, 16], got"))):
        if not re.search(pattern, results[rank][-1]):
            wrong.append(f"ContextParallelAttention: rank {rank} said {results[rank][-1]!r}, expected /{pattern}/")
    assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------------------------
# Layouts and argument checks (no process group needed)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("length,world", [(0, 2), (1, 2), (7, 2), (13, 4), (16, 4), (9, 3), (5, 1)])
def test_shards_partition_the_sequence(layout, length, world):
    pos = [shard_positions(length, world, r, layout) for r in range(world)]
    assert [p.numel() for p in pos] == shard_sizes(length, world, layout)
    assert torch.equal(torch.cat(pos).sort().values, torch.arange(length))
    assert max(shard_sizes(length, world, layout)) - min(shard_sizes(length, world, layout)) <= 2


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    length, world = 64, 4

    def work(layout):  # allowed (query, key) pairs per rank under a causal mask
        return [int((shard_positions(length, world, r, layout) + 1).sum()) for r in range(world)]

    assert work("zigzag") == [520] * 4
    assert work("contiguous") == [136, 392, 648, 904]


def test_zigzag_layout_drawn_in_the_docstring():
    assert shard_positions(10, 2, 0, "zigzag").tolist() == [0, 1, 2, 8, 9]
    assert shard_positions(10, 2, 1, "zigzag").tolist() == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("kwargs,kind,match", [
    ({"layout": "striped"}, ValueError, "layout must be one of"),
    ({"window": (1,)}, ValueError, "window must be a"),
    ({"window": (-1, 0)}, ValueError, "window left must be None or a non-negative int"),
    ({"is_causal": 1}, TypeError, "is_causal must be a bool"),
    ({"scale": float("nan")}, ValueError, "scale must be a finite number"),
    ({"mask_mod": 3}, TypeError, "mask_mod must be callable, got int"),
    ({"mask_mod": lambda b, h, q, kv: (q - kv).float()}, TypeError, "mask_mod .*returned"),
])
def test_bad_arguments_are_named(kwargs, kind, match):
    q = torch.randn(2, 4, 3, 8)
    with pytest.raises(kind, match=match):
        ring_attention(q, q[:, :2], q[:, :2], **kwargs)


@pytest.mark.parametrize("q,k,v,match", [
    (torch.randn(4, 3, 8), torch.randn(4, 3, 8), torch.randn(4, 3, 8), r"query must be \[B, heads, L_local, dim\]"),
    (torch.randn(1, 3, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), r"multiple of key/value heads \(2\)"),
    (torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), "key head size 4 must equal"),
    (torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), "value must have the same heads"),
    (torch.randn(2, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), r"key batch dims \(1,\) must equal"),
])
def test_bad_shapes_are_named(q, k, v, match):
    with pytest.raises(ValueError, match=match):
        ring_attention(q, k, v)


def test_without_a_process_group_the_error_says_what_to_do():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard(q, 2, layout="zigzag")


def test_shard_checks_dim_and_layout():
    with pytest.raises(ValueError, match=r"dim must be an int in \[-2, 2\)"):
        shard(torch.zeros(2, 3), 2)
    with pytest.raises(ValueError, match="layout must be one of"):
        unshard(torch.zeros(2, 3), 1, layout="ring")


def test_context_parallel_refuses_what_it_cannot_do():
    with pytest.raises(TypeError, match="attn must be an attnkit.MultiHeadAttention"):
        ContextParallelAttention(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="layout must be one of"):
        ContextParallelAttention(attnkit.MultiHeadAttention(8, 2), layout="rows")
    cp = ContextParallelAttention(attnkit.MultiHeadAttention(8, 2, dropout=0.1))
    with pytest.raises(ValueError, match="does not implement attention dropout"):
        cp(torch.randn(1, 3, 8))



@pytest.mark.slow
@pytest.mark.timeout(120)
def test_example_trains_with_the_single_process_loss():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "ring_train.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           "--steps", "2", "--dtype", "float64"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.count("single process") == 2 and "losses match the single-process run" in res.stdout


# --------------------------------------------------------------------------------------------
# unshard called differently: every rank raises, naming the rank and what differs
# --------------------------------------------------------------------------------------------

# (what differs, rank 0's x, rank 1's x, what both ranks raise). Before, a different dtype or size
# made gloo abort a rank (SIGABRT), and sizes swapped between two dimensions mixed up rows silently.
_UNSHARD_MISMATCHES = [
    ("heads", dict(shape=(2, 4, 3, 8)), dict(shape=(2, 3, 3, 8)),
     r"unshard: rank 1 has shape=\(2, 3, L_local, 8\) but rank 0 has shape=\(2, 4, L_local, 8\)"),
    ("head size", dict(shape=(2, 4, 3, 8)), dict(shape=(2, 4, 3, 6)), r"rank 1 has shape=\(2, 4, L_local, 6\)"),
    ("swapped", dict(shape=(2, 4, 3, 6)), dict(shape=(2, 6, 3, 4)), r"rank 1 has shape=\(2, 6, L_local, 4\)"),
    ("dtype", dict(shape=(2, 4, 3, 8)), dict(shape=(2, 4, 3, 8), dtype=torch.float32),
     r"rank 1 has dtype=torch\.float32 but rank 0 has dtype=torch\.float64"),
    ("dimensions", dict(shape=(2, 4, 3, 8)), dict(shape=(8, 3, 8)), r"rank 1 has ndim=3 but rank 0 has ndim=4"),
    ("layout", dict(shape=(2, 4, 3, 8)), dict(shape=(2, 4, 3, 8), layout="zigzag"),
     r"rank 1 has layout='zigzag' but rank 0 has layout='contiguous'"),
    ("refused", dict(shape=(2, 4, 3, 8)), dict(shape=(2, 4, 3, 8), dim=7),
     (r"unshard: rank 1 refused its arguments", r"dim must be an int in \[-4, 4\)")),
]


def _mismatched_unshards(rank, world, cases):
    got = []
    for _, *calls, _ in cases:
        c = calls[rank]
        x = torch.zeros(c["shape"], dtype=c.get("dtype", torch.float64))
        try:
            out = unshard(x, c.get("dim", 2 if len(c["shape"]) == 4 else 1), layout=c.get("layout", "contiguous"))
        except (TypeError, ValueError) as e:
            got.append(str(e))
        else:
            got.append(f"no error: returned {tuple(out.shape)}")
    # Still in step: lengths 3 and 2 joined in rank order.
    full = unshard(torch.full((1, 2, 3 - rank, 4), float(rank)), 2)
    got.append(full[0, 0, :, 0].tolist())
    return got


@pytest.mark.timeout(90)
def test_unshard_called_differently_raises_on_every_rank_naming_what_differs(mismatched):
    results = mismatched["unshard"]
    wrong = []
    for i, (what, _, _, want) in enumerate(_UNSHARD_MISMATCHES):
        for rank in range(2):
            pattern = want[rank] if isinstance(want, tuple) else want
            if not re.search(pattern, results[rank][i]):
                wrong.append(f"{what}: rank {rank} said {results[rank][i]!r}, expected /{pattern}/")
    assert not wrong, "\n".join(wrong)
    assert results[0][-1] == results[1][-1] == [0.0, 0.0, 0.0, 1.0, 1.0]
