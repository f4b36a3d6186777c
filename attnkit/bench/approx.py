"""Benchmark suite ``approx``: what each approximation of :mod:`attnkit.approx` loses and what it saves.

* Quality on the bundled MiniLM (sentence embeddings): generated sentences of 4 to 60 words from
  a fixed grammar (``sentences(n)``, seeded), each method swapped into every layer and into the
  last layer only, without retraining; the mean and worst cosine against the exact model's
  embedding, and how often nearest-neighbour retrieval over the set agrees (top-1, top-5 overlap).
  Sentences are encoded in batches of equal token length, so no padding mask is involved (Linformer
  honours none) and Nystrom's landmarks see real tokens only.
Run it with one thread on a shared machine (``OMP_NUM_THREADS=1``): with more threads than free
cores every call spins and waits, and the times measure the neighbours. The report names the count.

* Cost against n: forward and forward + backward time of one attention call (B = 1, H = 4,
  D = 64, float32) for exact attention (SDPA, the banded kernel, the fused tiles: :data:`EXACT`)
  and each method, n = 1k ... 64k as far as each fits in 16 GiB and runs in seconds, each point
  in a fresh process that also reports its peak memory; the exponent fitted to ``time ~ n^p`` on
  log-log axes, and the first measured n where the method beats the fastest exact kernel; the
  additive score beside the dot product at the same sizes.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch

from .._io import atomic_write
from ._util import markdown_table, progress, write_report

_SUBJECTS = ["the old man", "a young woman", "my neighbour", "the committee", "our teacher", "a small dog",
             "the engineers", "her brother", "the city council", "a famous painter", "the children", "this company"]
_VERBS = ["wrote", "found", "painted", "sold", "repaired", "described", "ignored", "discovered", "built",
          "cancelled", "praised", "carried"]
_OBJECTS = ["a long letter", "the broken bicycle", "an old map of the harbour", "three red apples",
            "the new bridge", "a strange noise", "the annual report", "a wooden boat", "the quiet garden",
            "several blue paintings", "the evening train", "a forgotten song"]
_TAILS = ["after the storm", "in the morning", "before anyone noticed", "near the river", "during the winter",
          "without asking for help", "for the second time", "at the end of the street", "with great care",
          "while it was raining"]
_JOINS = ["and then", "because", "although", "so", "but later", "while"]


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct generated sentences of one to five clauses (about 4 to 60 words)."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        clauses = [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
                   + (f" {rng.choice(_TAILS)}" if rng.random() < 0.6 else "") for _ in range(rng.randint(1, 5))]
        text = clauses[0]
        for c in clauses[1:]:
            text += f" {rng.choice(_JOINS)} {c}"
        text = text[0].upper() + text[1:] + "."
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def _embed(model, texts: list[str], buckets: dict[int, list[int]]) -> torch.Tensor:
    """Sentence embeddings, each batch holding sentences of one token length (no padding)."""
    out = torch.empty(len(texts), model.config.hidden_size)
    with torch.inference_mode():
        for idx in buckets.values():
            out[idx] = model.encode([texts[i] for i in idx], batch_size=len(idx))
    return out


def _retrieval(exact: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Top-1 agreement and mean top-5 overlap of nearest neighbours (each sentence excluded from its own list)."""
    def top(e: torch.Tensor) -> torch.Tensor:
        sim = e @ e.T
        sim.fill_diagonal_(-math.inf)
        return sim.topk(5, dim=1).indices

    a, b = top(exact), top(other)
    top1 = (a[:, 0] == b[:, 0]).double().mean().item()
    top5 = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b, strict=True)) / (5 * len(a))
    return top1, top5


def quality_rows(quick: bool) -> tuple[list[list[object]], int, int]:
    from ..models import Bert

    model = Bert.from_pretrained()
    n = 64 if quick else 600
    texts = sentences(n)
    buckets: dict[int, list[int]] = {}
    for i, t in enumerate(texts):
        buckets.setdefault(len(model.tokenizer.tokenize(t)), []).append(i)
    longest = max(buckets) + 2  # [CLS] and [SEP]
    settings = ([("performer", {"num_features": 64}), ("nystrom", {"num_landmarks": 16}),
                 ("linformer", {"max_len": longest, "k": 16}), ("elu", {})] if quick else
                [("performer", {"num_features": 64}), ("performer", {"num_features": 256}),
                 ("nystrom", {"num_landmarks": 8}), ("nystrom", {"num_landmarks": 16}),
                 ("nystrom", {"num_landmarks": 32}), ("linformer", {"max_len": longest, "k": 16}),
                 ("linformer", {"max_len": longest, "k": 32}), ("elu", {}), ("relu", {}), ("dot", {})])
    exact = _embed(model, texts, buckets)
    last = len(model.layers) - 1
    rows = []
    for kind, args in settings:
        torch.manual_seed(0)  # Linformer's random projections
        for where, layers in (("all layers", None), (f"layer {last} only", [last])):
            emb = _embed(model.with_attention(kind, layers=layers, **args), texts, buckets)
            cos = (emb * exact).sum(-1)
            top1, top5 = _retrieval(exact, emb)
            setting = ", ".join(f"{k}={v}" for k, v in args.items() if k != "max_len") or "-"
            rows.append([kind, setting, where, cos.mean().item(), cos.min().item(), top1, top5])
    return rows, n, longest


#: the exact kernels measured beside the approximations, by backend name
EXACT = ("sdpa", "band", "fused_tiles")


def _call(kind: str, n: int, backward: bool):
    """One attention call by ``kind``: an approximation's name, or ``exact:<backend>``."""
    from .. import approx
    from ..functional import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 64, generator=g, requires_grad=backward) for _ in range(3))
    # FAVOR+ features drawn once, as a module holds them: the call measures attention, not the draw
    args: dict = {"performer": {"projection": approx.orthogonal_features(256, 64, generator=g).float()},
                  "nystrom": {"num_landmarks": 64},
                  "additive": {"score_vector": torch.randn(64, generator=g) / 8}}.get(kind, {})
    if kind == "linformer":
        args = {"projection": approx.LinformerProjection(n, 256).requires_grad_(backward)}

    def run():
        if kind.startswith("exact:"):
            out = attention(q, k, v, backend=kind.partition(":")[2])
        else:
            out = approx.attention(q, k, v, kind=kind, **args)
        if backward:
            out.sum().backward()

    return run


LIMIT_BYTES = 16 << 30  # the budget: a point that needs more is reported as not fitting
TOO_SLOW_S = 5.0  # a method stops growing n once one call takes longer than this
WARM_BUDGET_S = 10.0  # up to 3 timed calls after the warm-up call, while they fit in this


def _cost_child(kind: str, n: int, backward: bool) -> None:
    """In a fresh process capped at 16 GiB: time the calls, print the median and the peak memory as JSON.

    The first call warms up and is not timed (it pays for first-touch page faults of every new
    buffer, up to 4x a warm call at n = 64k, which bent the fitted exponents upwards); then up to 3
    timed calls while they fit in :data:`WARM_BUDGET_S`, at least one.

    The peak is ``VmHWM`` (this address space alone, see ``blockwise._peak_mb``) after the calls
    minus the resident memory just before them (runtime and inputs): what the call itself needs.
    The high-water mark is reset first (``clear_refs``), or the setup's temporaries (a Linformer
    projection's initialisation) would stand in for the call's peak.
    """
    import json
    import resource
    import time

    from .blockwise import _peak_mb

    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))
    torch.set_num_threads(1)
    call = _call(kind, n, backward)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS, the resident memory now
    except OSError:
        pass  # no /proc: the peak then counts the setup's too
    base = _peak_mb()
    call()
    times: list[float] = []
    while len(times) < 3 and (not times or sum(times) + times[-1] <= WARM_BUDGET_S):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"seconds": sorted(times)[len(times) // 2], "peak_mb": _peak_mb() - base}))


def _measure(kind: str, n: int, backward: bool) -> dict | None:
    """One point in a subprocess; None when it does not fit in the 16 GiB cap (or fails)."""
    import json
    import subprocess
    import sys

    code = f"from attnkit.bench.approx import _cost_child; _cost_child({kind!r}, {n}, {backward})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cost_rows(quick: bool, out_dir: Path, say=lambda _: None):
    sizes = [256, 512, 1024] if quick else [1024 << i for i in range(7)]  # 1k ... 64k
    exact_kinds = [f"exact:{b}" for b in EXACT]
    kinds = [*exact_kinds, "elu", "performer", "nystrom", "linformer", "additive", "dot"]
    times: dict[tuple[str, bool], dict[int, float]] = {}
    peaks: dict[tuple[str, bool], dict[int, float]] = {}
    for backward in (False, True):
        for kind in kinds:
            for n in sizes:
                if kind == "dot" and n not in times.get(("additive", backward), {}):
                    break  # the dot product only beside the additive score, at its sizes
                point = _measure(kind, n, backward)
                if point is None:
                    break  # does not fit in 16 GiB: neither will larger n
                times.setdefault((kind, backward), {})[n] = point["seconds"]
                peaks.setdefault((kind, backward), {})[n] = point["peak_mb"]
                say(f"{kind} {'fwd+bwd' if backward else 'fwd'} n={n}: {point['seconds']:.3g} s, "
                    f"{point['peak_mb']:.0f} MiB")
                if point["seconds"] > TOO_SLOW_S:
                    break
    rows = []
    for (kind, backward), t in times.items():
        ns = sorted(t)
        slope = _slope(ns, [t[n] for n in ns]) if len(ns) > 1 else float("nan")
        # the fastest exact kernel at each n is the one to beat
        exact = {n: min(times[(e, backward)][n] for e in exact_kinds if n in times.get((e, backward), {}))
                 for n in sizes if any(n in times.get((e, backward), {}) for e in exact_kinds)}
        shared = [n for n in ns if n in exact]
        beats = [n for n in shared if t[n] < exact[n]]
        cross = "-" if kind in exact_kinds or kind == "dot" else (
            str(beats[0]) if beats else f"> {shared[-1]}" if shared else "-")
        rows.append([kind, "fwd+bwd" if backward else "fwd", *[t[n] * 1e3 if n in t else "-" for n in sizes],
                     slope, cross])
    memory = [[kind, "fwd+bwd" if backward else "fwd", *[peak.get(n, "-") for n in sizes]]
              for (kind, backward), peak in peaks.items()]
    scores = [[n, "fwd+bwd" if backward else "fwd", dot[n] * 1e3, times[("additive", backward)][n] * 1e3,
               times[("additive", backward)][n] / dot[n]]
              for backward in (False, True) for dot in [times.get(("dot", backward), {})] for n in sorted(dot)]
    pic = _plot(times, peaks, out_dir / "approx_cost.png")
    return rows, memory, scores, pic, sizes


def _slope(ns: list[int], ts: list[float]) -> float:
    """Least-squares slope of log t against log n: the fitted exponent p of ``t ~ n^p``."""
    x = [math.log(n) for n in ns]
    y = [math.log(t) for t in ts]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum((a - mx) ** 2 for a in x)


def _plot(times, peaks, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    panels = ((times, False, 1e3, "ms", "forward"), (times, True, 1e3, "ms", "forward + backward"),
              (peaks, True, 1.0, "peak MiB", "forward + backward memory"))
    for ax, (values, backward, unit, ylabel, title) in zip(axes, panels, strict=True):
        for (kind, bwd), t in values.items():
            if bwd == backward:
                ns = sorted(t)
                ax.loglog(ns, [max(t[n], 1e-3) * unit for n in ns], "o-", label=kind)
        ax.set(xlabel="n (tokens)", ylabel=ylabel, title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=80))
    plt.close(fig)
    return path


def run(quick: bool, out_dir: Path) -> str:
    say = progress("approx")
    qrows, n, longest = quality_rows(quick)
    say("quality")
    crows, mrows, srows, pic, sizes = cost_rows(quick, out_dir, say)
    say("cost")
    body = (f"## Quality: bundled MiniLM, {n} generated sentences (`attnkit.bench.approx.sentences`), up to "
            f"{longest} tokens\n\nCosine of each sentence embedding with the exact model's; retrieval: the "
            "nearest neighbour (top-1) and the 5 nearest (top-5 overlap) over the same set, against the exact "
            "model's. Linformer's projections are random (they are trained with a model, and this one was not).\n\n"
            + markdown_table(["method", "setting", "swapped", "mean cos", "worst cos", "top-1 agree",
                              "top-5 overlap"], qrows)
            + "\n\n## Cost: one attention call, B = 1, H = 4, D = 64, float32\n\n"
            "Each point in a fresh process capped at 16 GiB, one thread; milliseconds per call: the median of up "
            f"to 3 calls after one untimed warm-up call (fewer when they take over {WARM_BUDGET_S:.0f} s). A method "
            "stops at the first n that does not fit in 16 GiB or after a call over "
            f"{TOO_SLOW_S:.0f} s. `exact:<backend>` is `attnkit.attention(..., backend=...)`: PyTorch's SDPA, "
            "attnkit's banded C++ kernel, and its tiles through PyTorch's fused kernel. p: exponent fitted to "
            "time ~ n^p over its measured n; crossover: the first n where the method is faster than the fastest "
            "exact kernel at that n.\n\n"
            + markdown_table(["method", "pass", *[f"n={s} ms" for s in sizes], "p", "beats exact from n"], crows)
            + "\n\nPeak memory of the call in MiB: the process's peak resident memory (`VmHWM`) minus its resident "
            "memory just before the calls (Python, torch and the inputs).\n\n"
            + markdown_table(["method", "pass", *[f"n={s} MiB" for s in sizes]], mrows)
            + "\n\n## Additive against dot-product scores at the same sizes\n\nThe same call with Bahdanau's "
            "score `w . tanh(q + k)` (A = 64, q and k already projected) and with the unscaled dot product "
            "(`kind=\"dot\"`, exact attention through SDPA). The additive score is built a block of query rows at a "
            "time: its memory is a few n x n score tensors (the n x n x A tanh tensor is never whole, see the "
            "memory table), its cost the n * n * A tanh.\n\n"
            + markdown_table(["n", "pass", "dot ms", "additive ms", "additive / dot"], srows)
            + f"\n\n![cost against n]({pic.name})\n")
    # threads=1: the cost points run in child processes of one thread (the quality part is not timed)
    return write_report(out_dir, "approx", "Approximate attention: quality on MiniLM and cost against n", body,
                        f"attnkit bench approx{' --quick' if quick else ''}", threads=1)
