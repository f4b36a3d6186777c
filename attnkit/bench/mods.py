"""``attnkit bench mods``: masks and scores as users write them, against SDPA, FlexAttention and
attnkit's own helpers.

Each family is written the way a FlexAttention user writes it (torch's ``and_masks``/``or_masks``,
closures over tensors, a hand-written ALiBi), never with an attnkit helper, and handed unchanged
to ``attnkit.attention``. The mask plan finds the rows' key intervals and the score probe the
diagonal bias, so they run where attnkit's helpers run. Anchors measured in the same run: SDPA
with the dense mask or bias, compiled FlexAttention (forward; in its own process, compile time
apart), the same maths through attnkit's helper, and the matmul throughput. A last section keeps
one of the two cores busy with another process.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import masks, per_element, scores
from ..functional import attention, which_backend
from ..maskplan import mask_plan
from ._util import (
    attention_flops,
    interleaved_medians,
    markdown_table,
    matmul_gflops,
    median_time,
    progress,
    write_report,
)

H, D = 8, 64
#: The family whose mask depends on the head (its dense mask and FlexAttention's block mask are per head).
PER_HEAD = "causal window per head (16-256 keys)"


def families(n: int) -> dict:
    """name -> (mask_mod, score_mod, attnkit's helper arguments or None), written as a user would."""
    from torch.nn.attention.flex_attention import and_masks, or_masks

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 64

    docs = torch.arange(n) // (n // 8)

    def document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    def dilated(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() <= 64) & ((q_idx - kv_idx) % 2 == 0)

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 64

    def global_key(b, h, q_idx, kv_idx):
        return kv_idx < 16

    def global_query(b, h, q_idx, kv_idx):
        return q_idx < 16

    widths = torch.tensor([16, 32, 48, 64, 96, 128, 192, 256])[:H]  # a window per head (local and wider heads)

    def window_per_head(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= widths[h])

    layout = masks.bigbird_layout(-(-n // 64), seed=0)  # blocks of 64: 3 around the diagonal, 2 global, 3 random

    def bigbird(b, h, q_idx, kv_idx):
        return layout[q_idx // 64, kv_idx // 64]

    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    # a learned bias per head and clipped distance (Shaw et al.), trained along with the model
    table = (0.1 * torch.randn(H, 2 * 128 + 1, generator=torch.Generator().manual_seed(0))).requires_grad_()

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - q_idx).clamp(-128, 128) + 128]

    return {
        "causal sliding window 64 (and_masks)": (and_masks(causal, sliding), None, {"window": (64, 0)}),
        "packed documents, causal (8 docs)": (and_masks(causal, document), None,
                                              {"mask_mod": masks.and_masks(masks.document_mod(docs),
                                                                           masks.causal_mod())}),
        "dilated sliding window 64, dilation 2": (dilated, None, None),
        "window 64 + 16 global tokens (or_masks)": (or_masks(near, global_key, global_query), None, None),
        PER_HEAD: (window_per_head, None, None),
        "BigBird block layout (64: 3 window, 2 global, 3 random)": (bigbird, None,
                                                                    {"mask_mod": masks.block_sparse_mod(layout, 64)}),
        "hand-written ALiBi, causal": (causal, alibi, {"is_causal": True,
                                                       "score_mod": scores.alibi(slopes)}),
        "hand-written ALiBi, no mask": (None, alibi, {"score_mod": scores.alibi(slopes)}),
        "hand-written relative bias (learned, clipped at 128), causal": (
            causal, relative, {"is_causal": True, "score_mod": scores.relative_position_bias(table, 128)}),
    }


def _dense(n: int, mask_mod, score_mod) -> dict:
    """SDPA's arguments for a family: the mask or bias materialised."""
    i, j = torch.arange(n).view(1, 1, -1, 1), torch.arange(n).view(1, 1, 1, -1)
    h = torch.arange(H).view(1, -1, 1, 1)
    if score_mod is None:
        return {"attn_mask": masks.materialize(mask_mod, 1, H, n, n)}
    bias = score_mod(torch.zeros(1, H, n, n), torch.zeros((), dtype=torch.long), h, i, j)
    if mask_mod is not None:
        bias = bias.masked_fill(~masks.materialize(mask_mod, 1, 1, n, n), float("-inf"))
    # a learned table's dense bias: a leaf that takes SDPA's gradient (the gather back into the
    # table is not timed, which favours SDPA)
    return {"attn_mask": bias.detach().requires_grad_(bias.requires_grad)}


def _element_check(mod, n: int, tries: int = 3) -> float:
    """Median seconds of the check, made once per mod (not per plan), of whether ``mod`` must be
    evaluated per element: its broadcasting call against vmapped per-element calls on a few indices."""
    times = []
    for _ in range(tries):
        per_element._per_element.pop(mod, None)
        t0 = time.perf_counter()
        per_element.evaluator(mod, (1, H, n, n), "cpu")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _analysis(mask_mod, score_mod, n: int, builds: int = 7) -> tuple[float, str]:
    """What the first call makes for this family, a fresh mask plan and score probe, timed apart:
    the median seconds of ``builds`` fresh builds, and how the plan's intervals were found."""
    times, how = [], "-"
    for _ in range(builds):
        scores._verified.clear()
        t0 = time.perf_counter()
        if mask_mod is not None:
            how = mask_plan(mask_mod, q_len=n, heads=H).derived_by
        if score_mod is not None:
            scores.diagonal_bias(score_mod, batch=1, heads=H, q_len=n, kv_len=n, dtype=torch.float32)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), how


def _fb(fn, q, k, v):
    def run():
        for t in (q, k, v):
            t.grad = None
        out = fn()
        out.backward(torch.ones_like(out))
    return run


def _flex_child(n: int, rounds: int) -> None:
    """Compiled FlexAttention, forward, for every family; print JSON. Its own process: the compiled
    kernel keeps OpenMP threads that would disturb the parent's later measurements."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
    out = {}
    for name, (mask_mod, score_mod, _) in families(n).items():
        # each family compiled afresh, as its users would: compiled in one go, the families' masks
        # and score_mods go past dynamo's recompile limit and the last ones run flex_attention eagerly
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention)
        try:
            t0 = time.perf_counter()
            heads = H if name == PER_HEAD else None
            block = create_block_mask(mask_mod, None, heads, n, n, device="cpu") if mask_mod is not None else None
            with torch.no_grad():
                compiled(q, k, v, score_mod=score_mod, block_mask=block)
            first = time.perf_counter() - t0
            with torch.no_grad():
                t = interleaved_medians({"flex": lambda b=block, s=score_mod, c=compiled: c(q, k, v, score_mod=s,
                                                                                            block_mask=b)},
                                        repeat=rounds)["flex"]
            out[name] = {"flex": t, "compile_s": first}
            if mask_mod is not None:  # its own analysis of the mask: as users call it, and compiled (warm)
                out[name]["mask_s"] = median_time(lambda m=mask_mod, h=heads: create_block_mask(
                    m, None, h, n, n, device="cpu"), repeat=1, warmup=0)
                out[name]["mask_compiled_s"] = median_time(lambda m=mask_mod, h=heads: create_block_mask(
                    m, None, h, n, n, device="cpu", _compile=True), repeat=3)
        except Exception as e:  # reported verbatim in the table
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]}
    print(json.dumps(out))


def _child(call: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", f"from attnkit.bench.mods import _flex_child; {call}"],
                          capture_output=True, text=True, timeout=1800)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}


def _busy() -> subprocess.Popen:
    """Another process keeping one core busy (pure Python, one thread)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _busy_core_times(cands: dict, rounds: int, seconds: float = 0.6) -> tuple[dict, dict]:
    """Each candidate's time per call, quiet and with one core busy: in each round, every candidate
    runs a block of calls (``seconds`` long) quiet, then again beside `_busy`; the per-call median of
    each block, then the median over rounds. Blocks, not calls interleaved across candidates: a short
    call made straight after a long one on both cores pays the scheduler's debt to the busy process
    (it lets that process catch up), which would be charged to whichever candidate runs second."""
    per_call = {c: median_time(fn, repeat=3) for c, fn in cands.items()}
    block = {c: max(5, round(seconds / t)) for c, t in per_call.items()}
    quiet: dict[str, list[float]] = {c: [] for c in cands}
    loaded: dict[str, list[float]] = {c: [] for c in cands}
    for _ in range(rounds):
        for c, fn in cands.items():
            quiet[c].append(median_time(fn, repeat=block[c]))
        busy = _busy()
        try:
            time.sleep(0.5)
            for c, fn in cands.items():
                loaded[c].append(median_time(fn, repeat=block[c]))
        finally:
            busy.kill()
            busy.wait()
        time.sleep(0.3)
    return ({c: statistics.median(t) for c, t in quiet.items()}, {c: statistics.median(t) for c, t in loaded.items()})


def run(quick: bool, out_dir: Path) -> str:
    say = progress("mods")
    n = 1024 if quick else 8192
    rounds = 2 if quick else 5
    peak = matmul_gflops(1024 if quick else 2048)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, generator=g).requires_grad_() for _ in range(3))
    header = ["mod as the user wrote it", "attnkit path", "plan derived by", "analysis ms, once (of a fwd)",
              "attnkit fwd ms", "attnkit fwd+bwd ms", "SDPA dense fwd ms", "SDPA dense fwd+bwd ms", "fwd+bwd vs SDPA",
              "helper fwd ms", "helper fwd+bwd ms", "user / helper (fwd, fwd+bwd)"]
    rows, fwd_times, analysis_times, checks = [], {}, {}, {}
    for name, (mask_mod, score_mod, helper) in families(n).items():
        say(name)
        kw = {"mask_mod": mask_mod, "score_mod": score_mod}
        analysis, how = _analysis(mask_mod, score_mod, n)
        path = which_backend(q, k, v, **kw)  # builds and caches the plan for the timed calls
        dense = _dense(n, mask_mod, score_mod)
        cands = {"mine": lambda kw=kw: attention(q, k, v, **kw),
                 "sdpa": lambda d=dense: F.scaled_dot_product_attention(q, k, v, **d)}
        if helper is not None:
            cands["helper"] = lambda h=helper: attention(q, k, v, **h)
        with torch.no_grad():
            fwd = interleaved_medians(cands, repeat=rounds)
        fb = interleaved_medians({key: _fb(fn, q, k, v) for key, fn in cands.items()}, repeat=rounds)
        fwd_times[name] = fwd["mine"]
        if mask_mod is not None:  # the mask plan alone, against FlexAttention's block mask below
            analysis_times[name] = analysis if score_mod is None else _analysis(mask_mod, None, n)[0]
            checks[name] = _element_check(mask_mod, n)
        share = f"{analysis * 1e3:.{1 if analysis < 0.01 else 0}f} ({analysis / fwd['mine']:.0%})"
        rows.append([name, path, how, share, fwd["mine"] * 1e3, fb["mine"] * 1e3, fwd["sdpa"] * 1e3, fb["sdpa"] * 1e3,
                     f"{fb['sdpa'] / fb['mine']:.1f}x faster",
                     fwd["helper"] * 1e3 if helper else "-", fb["helper"] * 1e3 if helper else "-",
                     f"{fwd['mine'] / fwd['helper']:.2f}, {fb['mine'] / fb['helper']:.2f}" if helper else "-"])
    say("FlexAttention (own process)")
    flex = _child(f"_flex_child({n}, {rounds})")
    flex_rows, mask_rows = [], []
    for name, t in fwd_times.items():
        got = flex.get(name, flex)
        if "error" in got:
            flex_rows.append([name, t * 1e3, f"failed: {got['error']}", "-"])
            continue
        flex_rows.append([name, t * 1e3, got["flex"] * 1e3, f"{got['flex'] / t:.2f}"])
        if "mask_s" in got:
            mine = analysis_times[name]  # (a family with a mask_mod has both)
            mask_rows.append([name, mine * 1e3, checks[name] * 1e3, got["mask_s"] * 1e3, got["mask_compiled_s"] * 1e3,
                              f"{got['mask_s'] / mine:.0f}x, {got['mask_compiled_s'] / mine:.1f}x"])
    say("busy core")
    nb = 1024 if quick else 4096
    qb, kb, vb = (x.detach()[:, :, :nb] for x in (q, k, v))
    small = families(nb)
    user_causal, per_head = small["causal sliding window 64 (and_masks)"][0], small[PER_HEAD][0]
    dense_b = masks.materialize(user_causal, 1, 1, nb, nb)
    cands = {"attnkit, user mask_mod": lambda: attention(qb, kb, vb, mask_mod=user_causal),
             "attnkit, a window per head": lambda: attention(qb, kb, vb, mask_mod=per_head),
             "SDPA, dense mask": lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=dense_b)}
    with torch.no_grad():
        quiet, loaded = _busy_core_times(cands, rounds)
    busy_rows = [[c, quiet[c] * 1e3, loaded[c] * 1e3, f"{loaded[c] / quiet[c]:.2f}x"] for c in cands]
    slow = {c: loaded[c] / quiet[c] for c in cands}
    cells = attention_flops(n, n, D, H)
    body = (f"B=1, H={H}, D={D}, float32, n = {n}; medians of {rounds} interleaved rounds. Matmul anchor measured "
            f"in this run: {peak:.0f} GFLOP/s (a full n x n forward at that rate: {cells / peak / 1e6:.0f} ms). "
            "Each mod is written as a FlexAttention user writes it (torch's and_masks/or_masks, closures over "
            "tensors, a hand-written ALiBi) and passed unchanged. The first call builds the mask plan and probes "
            "the score_mod (`analysis`: the median of 7 fresh builds, timed on their own and as a share of one "
            "forward); later calls reuse the plan and skip the probe's check. A plan is `derived by` closed form "
            "(the predicate run once on each row's values as affine pieces along the keys), ranges (run on "
            "ranges of indices tile by tile, and on the cells of the tiles that ranges cannot settle) or every "
            "cell, the first of these that can follow the predicate.\n\n"
            + markdown_table(header, rows)
            + "\n\n### Against compiled FlexAttention, forward (its own process; compile time apart)\n\n"
            + markdown_table(["mod", "attnkit fwd ms", "FlexAttention fwd ms", "Flex / attnkit"], flex_rows)
            + "\n\n### The analysis against FlexAttention's own: `create_block_mask`\n\n"
            + "What FlexAttention does with the same mask_mod before its first call: `create_block_mask` as "
              "users call it (one build), and with `_compile=True` (the median of 3 builds after the one that "
              "compiles). It finds each 128 x 128 tile's kind; attnkit's mask plan (the analysis above without "
              "the score probe) finds each row's exact intervals. Beside it, what attnkit does once per mod, "
              "not per plan: the check of whether the mod must be evaluated per element (its broadcasting call "
              "against vmapped per-element calls on a few indices; the median of 3, made afresh).\n\n"
            + markdown_table(["mod", "attnkit mask plan ms", "per-element check, once per mod ms",
                              "create_block_mask ms", "compiled, warm ms", "Flex / attnkit (as called, compiled)"],
                             mask_rows)
            + f"\n\n### One core busy with another process, n = {nb}, user mask_mods\n\n"
            + "Per-call medians of blocks of calls (about 0.6 s each), quiet and beside a process spinning on one "
              f"core, median over {rounds} rounds.\n\n"
            + markdown_table(["candidate", "quiet ms", "one core busy ms", "slowdown"], busy_rows)
            + "\n\nattnkit's slowdown / SDPA's slowdown (target <= 1.2): "
            + ", ".join(f"{c[9:]} {slow[c] / slow['SDPA, dense mask']:.2f}" for c in cands if c.startswith("attnkit"))
            + ".")
    return write_report(out_dir, "mods", "Masks and scores as users write them", body,
                        "attnkit bench mods" + (" --quick" if quick else ""))
