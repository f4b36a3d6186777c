"""The NaN/inf rule (:mod:`attnkit.nonfinite`) on every backend: a grid of poisons x masks x dtypes.

The grid: every registered CPU backend but ``flex`` (whose compiles would cost minutes here; its own
NaN cases are in ``tests/backends/test_flex.py``) x two shapes x the mask kinds (none, causal, window,
padding, documents, a dense mask with a fully masked row) x float32, float64, bfloat16 and float16.
Each case poisons one input at one place (a query row; a key or value row; a bias cell; a
score_mod's diagonal made NaN or +inf), at a place some rows allow and others do not, and checks, forward and
backward, against what the rule says, worked out here from the allowed grid of the independent
oracle (:func:`tests.support.oracle.allowed_grid`):

* a poisoned row is NaN, every element; so are its ``dq`` row, the ``dk``/``dv`` rows of the keys it
  allows and its allowed cells' ``dbias``;
* every other row, and every other gradient row, equals bit for bit the same call with the
  poisoned entries put back to their finite values (a dead row, then, is zeros).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import masks, nonfinite, scores
from attnkit.cache import KVCache, visible
from attnkit.call import validate_call
from tests.support import oracle

NAN, INF = float("nan"), float("inf")
BACKENDS = ["auto", "reference", "sdpa", "band", "fused_tiles", "tiles"]
QUERY_DOCS = torch.tensor([0] * 4 + [1] * 6 + [2] * 2)  # queries 10, 11: a document with no keys
KEY_DOCS = torch.tensor([0] * 4 + [1] * 8)
#: (query heads, key/value heads, Lq, Lk): plain, and grouped-query heads with Lq < Lk (bottom-right).
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = {"square": (2, 2, 12, 12), "gqa, Lq < Lk": (2, 1, 7, 12)}


# Shapes this small are all thread hand-offs: one thread runs the grid several times faster.
pytestmark = pytest.mark.usefixtures("one_thread")


def _dense_mask(lq, lk):
    g = torch.Generator().manual_seed(3)
    m = torch.rand(1, 1, lq, lk, generator=g) < 0.6
    m[..., 3, :] = False  # a dead row
    return m


#: name -> (attention kwargs, kwargs for the oracle's grid) for Lq, Lk.
MASKS = {
    "none": lambda lq, lk: ({}, {}),
    "causal": lambda lq, lk: ({"is_causal": True}, {"is_causal": True}),
    "window": lambda lq, lk: ({"window": (3, 1)}, {"window": (3, 1)}),
    "dense": lambda lq, lk: ({"mask": _dense_mask(lq, lk)}, {"mask": _dense_mask(lq, lk)}),
    "padding mod": lambda lq, lk: ({"mask_mod": masks.padding_mod(torch.tensor([8]))},
                                   {"mask_mod": masks.padding_mod(torch.tensor([8]))}),
    "documents": lambda lq, lk: (
        {"mask_mod": masks.and_masks(masks.document_mod(QUERY_DOCS[-lq:], KEY_DOCS), masks.causal_mod(lk - lq))},
        {"mask_mod": masks.and_masks(masks.document_mod(QUERY_DOCS[-lq:], KEY_DOCS), masks.causal_mod(lk - lq))}),
}


def _poison_table(lq, lk):
    """Every poison: name -> (input, index, value). ``input`` is q/k/v/bias/table (the score_mod's)."""
    d = lambda dist: lk + dist  # noqa: E731 - the table column of a key ``dist`` after the query
    return {
        "q NaN": ("q", (0, 0, 5, 1), NAN),
        "q +inf, row 3 (dead under the dense mask)": ("q", (0, 0, 3, 0), INF),
        "k NaN, early key": ("k", (0, 0, 2, 3), NAN),
        "k NaN, late key": ("k", (0, 0, 9, 3), NAN),
        "k -inf": ("k", (0, 0, 9, 0), -INF),
        "v NaN": ("v", (0, 0, 9, 2), NAN),
        "v +inf": ("v", (0, 0, 2, 2), INF),
        "bias NaN, a key after the query": ("bias", (0, 0, 2, 5), NAN),
        "bias NaN, a key before the query": ("bias", (0, 0, 5, 2), NAN),
        "bias +inf": ("bias", (0, 1, 4, 8), INF),
        "bias -inf row, q NaN there": ("q", (0, 0, 6, 0), NAN),
        "score_mod NaN, 2 keys after": ("table", (0, d(2)), NAN),
        "score_mod NaN, 1 key before": ("table", (1, d(-1)), NAN),
        "score_mod +inf, 1 key after": ("table", (0, d(1)), INF),
        "score_mod +inf, on the diagonal and 1 key before": ("table", [(1, d(0)), (1, d(-1))], INF),
    }


def _inputs(h, hkv, lq, lk, dtype, with_bias, bias_grad):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, lq, 8, generator=g, dtype=dtype)
    k = torch.randn(1, hkv, lk, 8, generator=g, dtype=dtype)
    v = torch.randn(1, hkv, lk, 8, generator=g, dtype=dtype)
    bias = torch.randn(1, h, lq, lk, generator=g, dtype=dtype) if with_bias else None
    if bias is not None:
        bias[:, :, 6] = -INF  # row 6 masked by its bias: dead, even with a NaN query
    table = torch.randn(h, 2 * lk + 1, generator=g, dtype=dtype)
    return {"q": q, "k": k, "v": v, "bias": bias, "table": table}


def _expected(allowed, t, where, index, kw, lq, lk, hkv):
    """Poisoned rows ``[1, H, Lq]`` and keys ``[1, Hkv, Lk]`` as the rule says, from first principles."""
    h = allowed.shape[1]
    allowed = allowed.clone()
    if t["bias"] is not None:
        allowed &= t["bias"] != -INF
    live = allowed.any(-1)
    bad_cell = torch.zeros_like(allowed)
    if where == "q":
        bad_cell[0, index[1], index[2], :] = True
    elif where in ("k", "v"):
        bad_cell[0, [i for i in range(h) if i * hkv // h == index[1]], :, index[2]] = True
    elif where == "bias":
        bad_cell[index] = True
    else:  # the score_mod's table: column lk + d, a key d positions after the query's position
        for head, column in index if isinstance(index, list) else [index]:
            for i in range(lq):
                j = i + (lk - lq) + column - lk
                if 0 <= j < lk:
                    bad_cell[0, head, i, j] = True
    poisoned = live & (allowed & bad_cell).any(-1) if where != "q" else live & bad_cell.any(-1)
    seen = (allowed & poisoned[..., None]).any(-2)  # [1, H, Lk]
    keys = torch.stack([seen[:, [i for i in range(h) if i * hkv // h == j]].any(1) for j in range(hkv)], 1)
    return poisoned, keys, allowed & poisoned[..., None]


def _run(backend, t, kw, with_score_mod, lk, lq, grad=True):
    leaves = [t["q"], t["k"], t["v"]] + ([t["bias"]] if t["bias"] is not None and t["bias"].requires_grad else [])
    extra = dict(kw)
    if t["bias"] is not None:
        extra["bias"] = t["bias"]
    if with_score_mod:
        extra["score_mod"] = scores.relative_position_bias(t["table"], lk, offset=lk - lq)
    if not grad:  # inference: the banded kernel's own pass answers for q, k and v (nonfinite.call)
        with torch.no_grad():
            return attnkit.attention(t["q"], t["k"], t["v"], backend=backend, **extra), ()
    out = attnkit.attention(t["q"], t["k"], t["v"], backend=backend, **extra)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return out.detach(), torch.autograd.grad(out, leaves, dout)


def _serves(backend, t, kw, with_score_mod, lk, lq) -> bool:
    extra = dict(kw)
    if t["bias"] is not None:
        extra["bias"] = t["bias"]
    if with_score_mod:
        extra["score_mod"] = scores.relative_position_bias(t["table"], lk, offset=lk - lq)
    req = validate_call(t["q"], t["k"], t["v"], **extra)  # a mistake in the test raises here
    try:
        attnkit.backends.select(req, backend)
    except ValueError:  # the backend cannot serve the call
        return False
    return True


def _check(name, got, want, nan_rows):
    """Rows where ``nan_rows`` all NaN, the others bit for bit ``want``'s; a list of what differs."""
    nan_rows = nan_rows.expand(got.shape[:-1])
    bad = []
    if not got[nan_rows].isnan().all():
        bad.append(f"{name}: a poisoned row is not NaN throughout")
    if not torch.equal(got[~nan_rows], want[~nan_rows]):
        diff = (got[~nan_rows] != want[~nan_rows]).any(-1).sum().item()
        bad.append(f"{name}: {diff} clean row(s) differ from the clean call (NaN: {got[~nan_rows].isnan().any()})")
    return bad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_poison_reaches_exactly_the_rows_that_see_it(backend, shape, mask, dtype):
    _grid(backend, shape, mask, dtype, grad=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", ["auto", "band", "decode"])
def test_poison_reaches_exactly_the_rows_that_see_it_without_a_gradient(backend, shape, mask, dtype):
    """The forward under no_grad, where the banded kernel's statistics (and the decode kernel's flag, for the few
    queries it takes) answer for q, k and v."""
    _grid(backend, shape, mask, dtype, grad=False)


def _grid(backend, shape, mask, dtype, grad):
    h, hkv, lq, lk = SHAPES[shape]
    kw, grid_kw = MASKS[mask](lq, lk)
    allowed = oracle.allowed_grid(1, h, lq, lk, **grid_kw)
    allowed = torch.ones(1, h, lq, lk, dtype=torch.bool) if allowed is None else allowed
    served, failures, clean_runs = 0, [], {}
    for poison, (where, index, value) in _poison_table(lq, lk).items():
        with_bias = where == "bias" or poison.startswith("bias")
        with_mod = where == "table"
        bias_grad = backend not in ("tiles", "fused_tiles")
        t = _inputs(h, hkv, lq, lk, dtype, with_bias, bias_grad)
        at = index if isinstance(index, list) else [index]
        if any(i >= n for one in at for i, n in zip(one, t[where].shape, strict=False)):
            continue
        call_kw = kw
        if backend == "sdpa" and mask in ("window", "padding mod", "documents"):  # SDPA takes a dense mask
            call_kw = {"mask": allowed[:1, :1]}
        if not _serves(backend, t, call_kw, with_mod, lk, lq):
            continue
        served += 1
        clean = {n: (x.clone().requires_grad_(n != "table" and (n != "bias" or bias_grad)) if x is not None else None)
                 for n, x in t.items()}
        dirty = {n: (x.clone() if x is not None else None) for n, x in t.items()}
        for one in at:
            dirty[where][one] = value
        for n in ("q", "k", "v", "bias"):
            if dirty[n] is not None:
                dirty[n].requires_grad_(n != "bias" or bias_grad)
        if (with_bias, with_mod) not in clean_runs:  # the clean call depends on these only
            clean_runs[with_bias, with_mod] = _run(backend, clean, call_kw, with_mod, lk, lq, grad)
        want_out, want_grads = clean_runs[with_bias, with_mod]
        got_out, got_grads = _run(backend, dirty, call_kw, with_mod, lk, lq, grad)
        rows, keys, cells = _expected(allowed, dirty, where, index, kw, lq, lk, hkv)
        failures += [f"{poison}: {f}" for f in _check("out", got_out, want_out, rows)]
        if not grad:
            continue
        failures += [f"{poison}: {f}" for f in _check("dq", got_grads[0], want_grads[0], rows)]
        failures += [f"{poison}: {f}" for f in _check("dk", got_grads[1], want_grads[1], keys)]
        failures += [f"{poison}: {f}" for f in _check("dv", got_grads[2], want_grads[2], keys)]
        if len(got_grads) > 3:  # dbias [1, H, Lq, Lk]: NaN at the poisoned rows' allowed cells
            failures += [f"{poison}: {f}" for f in _check("dbias", got_grads[3][..., None], want_grads[3][..., None],
                                                          cells)]
    if backend == "sdpa" and mask == "none" and shape == "square":
        assert served >= 8
    if served == 0:
        pytest.skip(f"{backend} serves none of the cases with mask {mask}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", ["band", "tiles", "reference"])
@pytest.mark.parametrize("where", ["q", "table"])
def test_a_learned_score_mod_table_gets_a_nan_gradient_once_a_row_is_poisoned(backend, where):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.randn(2, 21, generator=g, dtype=torch.float64)
    (q if where == "q" else table)[(0, 0, 6, 1) if where == "q" else (0, 9)] = NAN  # row 6; or diagonal -1
    table.requires_grad_()
    mod = scores.relative_position_bias(table, 10)
    out = attnkit.attention(q, k, v, is_causal=True, score_mod=mod, backend=backend)
    (grad,) = torch.autograd.grad(out, table, torch.ones_like(out))
    assert out[0, 0].isnan().any(-1).any() and torch.isfinite(out[0, 1]).all()
    assert grad.isnan().any()
    q[0, 0, 6, 1], table.data[0, 9] = 0.0, 0.0  # clean: a finite gradient
    out = attnkit.attention(q, k, v, is_causal=True, score_mod=mod, backend=backend)
    assert torch.isfinite(torch.autograd.grad(out, table, torch.ones_like(out))[0]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["reference", "tiles", "band"])
@pytest.mark.parametrize(("diagonals", "poisoned"), [([2, 3], [0, 1]), ([3], [0])],
                         ids=["two +inf in a row", "+inf beside visible keys"])
def test_a_score_mod_infinity_poisons_its_whole_row_forward_and_backward(backend, diagonals, poisoned, dtype):
    """A score_mod returning +inf at an allowed cell: its row is NaN, and so are ``dq`` there and ``dk``, ``dv``
    at every key the row allows (the reference backend once gave the row's weights as ``[0, NaN, 0, ...]``,
    leaving ``dv`` finite at the other keys)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 1, 4, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    table = torch.zeros(1, 9, dtype=dtype)
    table[0, [4 + d for d in diagonals]] = INF  # key i + d of query i: rows 0 and 1 only
    out = attnkit.attention(q, k, v, score_mod=scores.relative_position_bias(table, 4), backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    clean = [i for i in range(4) if i not in poisoned]
    assert out[0, 0, poisoned].isnan().all() and torch.isfinite(out[0, 0, clean]).all()
    assert dq[0, 0, poisoned].isnan().all() and torch.isfinite(dq[0, 0, clean]).all()
    assert dk.isnan().all() and dv.isnan().all()  # row 0 allows every key


def test_compiled_code_runs_the_backend_without_the_check():
    """The decision for torch.compile: no host read (it would break the graph), so no check there."""
    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(6)) for _ in range(3))
    fn = torch.compile(lambda a, b, c: attnkit.attention(a, b, c, is_causal=True), backend="eager", fullgraph=True)
    assert torch.equal(fn(q, k, v), attnkit.attention(q, k, v, is_causal=True))


def _both_checks(req):
    """The check's answer on the CPU path and on the path a device takes (one sync), which runs here on the CPU
    tensors: this machine has no device to send it down there."""
    return (nonfinite.all_finite(req),
            nonfinite._all_finite_one_sync(req.query, req.key, req.value, req.bias))


@pytest.mark.parametrize("aliasing", ["distinct", "k is v", "q is k is v"])
@pytest.mark.parametrize(("where", "value"), [("q", NAN), ("q", INF), ("k", -INF), ("k", NAN), ("v", INF),
                                              ("bias", NAN), ("bias", INF), ("bias", -INF)])
def test_the_check_finds_every_non_finite_input_on_both_paths(where, value, aliasing):
    g = torch.Generator().manual_seed(7)
    t = {"q": torch.randn(1, 2, 5, 8, generator=g), "k": torch.randn(1, 2, 5, 8, generator=g),
         "v": torch.randn(1, 2, 5, 8, generator=g), "bias": torch.randn(1, 2, 5, 5, generator=g)}
    if aliasing != "distinct":  # one tensor passed twice or three times is read once: still read
        t["v"] = t["k"] = t["q"] if aliasing == "q is k is v" else t["k"]
    req = validate_call(t["q"], t["k"], t["v"], bias=t["bias"])
    assert _both_checks(req) == (True, True)
    t[where][0, 1, 3, 2] = value
    want = where == "bias" and value == -INF  # a -inf bias masks its cell: no poison
    assert _both_checks(req) == (want, want)


def test_a_float16_sum_past_its_range_is_no_false_alarm():
    x = torch.full((1, 2, 64, 8), 60000.0, dtype=torch.float16)  # a float16 sum would be inf; float32's is not
    assert _both_checks(validate_call(x, x.clone(), x.clone())) == (True, True)


@pytest.mark.parametrize("flag", [True, False])
def test_vouched_tensors_answer_by_their_flag_until_written_in_place(flag):
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 2, 1, 8, generator=g)
    k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    nonfinite.vouch(torch.tensor(flag), k, v)
    req = validate_call(q, k, v)
    assert _both_checks(req) == (flag, flag)  # the flag is the answer, even a False one over finite tensors
    k[0, 1, 4, 0] = NAN  # by hand: k's vouch is void, k is read; v's still holds
    assert _both_checks(req) == (False, False)
    k[0, 1, 4, 0] = 0.0
    assert _both_checks(req) == (flag, flag)  # k read (finite), v's flag


def test_a_decode_step_check_reads_its_query_and_the_caches_flag_once_not_the_buffers():
    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((func.__name__, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    cache = KVCache(1, 32, 2, 8)
    cache.update(torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8))
    cached = cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    req = validate_call(torch.randn(1, 4, 1, 8), cached.k, cached.v, mask=visible(cached, 1, causal=True))
    with Ops() as ops:
        assert nonfinite.all_finite(req)
    assert not [op for op in ops.seen if (1, 2, 32, 8) in op[1]], ops.seen  # the buffers are not read
    assert [name for name, _ in ops.seen].count("_local_scalar_dense.default") == 2, ops.seen  # q's sum, one flag


def test_a_view_of_a_vouched_tensor_takes_its_flag_until_the_base_is_written():
    """The written part of a cache's buffers (what an eager decode step attends over) is a view: the cache's
    flag answers for it, and a write to the buffers through any view voids it for every view."""
    cache = KVCache(1, 32, 2, 8)
    cached = cache.update(torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8))
    k, v = cached.k[:, :, :9], cached.v[:, :, :9]
    req = validate_call(torch.randn(1, 2, 1, 8), k, v)
    assert nonfinite._vouched(k) is nonfinite._vouched(v) is not None
    assert _both_checks(req) == (True, True)
    cached.k[0, 0, 20, 0] = NAN  # by hand, outside the view but in its storage: the flag no longer holds
    assert nonfinite._vouched(k) is None
    assert _both_checks(req) == (True, True)  # read: the view itself is finite
    cached.k[0, 0, 3, 0] = NAN
    assert _both_checks(req) == (False, False)
