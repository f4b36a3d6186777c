"""``attnkit bench gpu``: attnkit on a CUDA device against the engines it stands on.

Kernels: for each mask family (causal; a causal sliding window; packed documents, causal;
Longformer: a two-sided window with global positions; causal with ALiBi; causal with a tanh soft
cap, as Gemma 2 has) and each length, in bfloat16, forward and forward+backward, in one run:

* ``attnkit.attention`` as ``backend="auto"`` chooses on CUDA (the table names the backend);
* compiled ``flex_attention`` with the ``BlockMask`` of its own ``create_block_mask`` (the same kernel
  attnkit's ``flex`` backend runs, with attnkit's BlockMask made from its mask plan instead);
* SDPA's flash kernel, for causal; SDPA with the dense bool mask, for the masks without a score mod;
* the time to work the mask out: ``attnkit.mask_plan`` and the ``BlockMask`` made from it, against
  ``create_block_mask``, compiled and warm;
* the first call of attnkit and of Flex at each length: both compile for the first sizes of a case and
  once more, with the lengths as variables, at the next (as attnkit's flex backend does on CUDA, and
  ``torch.compile``'s default), and no more after that;
* the largest difference between the two sides' forward outputs, which compute the same attention.

Models: a Llama-style and a Mistral-style model from transformers (random weights from a seeded
config, bfloat16, without the language-model head), one prefill without gradient under
``attn_implementation`` "attnkit", "sdpa" and "flex_attention", with each one's largest difference from
"sdpa" in the last hidden state.

Every timing is the median of device-synchronised runs after a first call (which may compile). Steps run
shortest first, at each length the models (a few compiles) before the kernels (many), and the table is
written again after every step, so a run stopped by a time limit keeps what it measured. A case that
fails (out of memory, a compile error) gets a row saying so and the run goes on. Without a CUDA device
the command stops with one line saying so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import attention, backends, mask_plan, masks, scores, which_backend
from ..backends import flex as flex_backend
from ..call import validate_call
from ._util import CannotMeasure, markdown_table, median_time, progress, write_report

SIZES = (4096, 8192, 16384, 32768)
MODEL_SIZES = (4096, 16384)
QUICK_SIZE = 4096
B, H, D = 1, 16, 128
DTYPE = torch.bfloat16
WINDOW = 1024  # the causal sliding window, and the Mistral-style model's
LONGFORMER = 256  # keys on each side of a Longformer row
GLOBALS = 16  # Longformer's global positions, spread evenly
SOFTCAP = 50.0
ROUNDS = 10
QUICK_ROUNDS = 3
MODEL_ROUNDS = 5
#: The models' shared shape: Llama's layer (RMSNorm, rotary, GQA with two query heads per key head, a
#: SiLU-gated MLP), 16 heads of 128, four layers. The Mistral-style one adds a sliding window of WINDOW.
MODEL = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 4,
         "num_attention_heads": 16, "num_key_value_heads": 8}
IMPLEMENTATIONS = ("attnkit", "sdpa", "flex_attention")

KERNEL_HEADER = ["mask", "n", "pass", "attnkit backend", "attnkit (ms)", "Flex + create_block_mask (ms)",
                 "attnkit speed / Flex's", "SDPA flash (ms)", "SDPA dense mask (ms)",
                 "attnkit plan + BlockMask (ms)", "create_block_mask, compiled (ms)",
                 "plan speed / create_block_mask's", "first call, attnkit / Flex (s)",
                 "largest difference from Flex"]
MODEL_HEADER = ["model", "n", "implementation", "attnkit backends", "prefill (ms)", "speed / sdpa's",
                "first call (s)", "largest difference from sdpa"]


def _compile(fn: Callable, fullgraph: bool = True) -> Callable:
    """``torch.compile(fn)`` as attnkit's flex backend compiles on CUDA: for the first sizes, then once more with
    sizes that changed as variables (TorchDynamo's automatic dynamic shapes); ``fullgraph``: no graph break
    allowed (for Flex, which would otherwise run its uncompiled maths and build every score)."""
    return torch.compile(fn, dynamic=None, fullgraph=fullgraph)


def _own(fn: Callable) -> Callable:
    """``fn`` behind a code object of its own, for :func:`_compile`: TorchDynamo keeps compiled graphs and counts
    recompiles per code object, and past its limit it runs ``flex_attention`` uncompiled, which builds every
    score. Each case compiling its own keeps every one of them compiled."""
    def run(*args, **kwargs):
        return fn(*args, **kwargs)
    run.__code__ = run.__code__.replace()
    return run


def _flex_for(name: str, compiled: dict) -> tuple[Callable, Callable]:
    """Case ``name``'s compiled ``create_block_mask`` and ``flex_attention``, made on first use and kept in
    ``compiled`` for the run's other lengths (as attnkit keeps its own)."""
    if name not in compiled:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled[name] = _compile(_own(create_block_mask), fullgraph=False), _compile(_own(flex_attention))
    return compiled[name]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], rounds: int, device: torch.device) -> tuple[float, float]:
    """``(seconds of the first call, median seconds of `rounds` calls after it)``, each call synchronised."""
    def synced():
        fn()
        _sync(device)

    _sync(device)
    start = time.perf_counter()
    synced()
    return time.perf_counter() - start, median_time(synced, repeat=rounds, warmup=0)


def _documents(n: int, device: torch.device) -> torch.Tensor:
    """Document ids ``[n]``: packed documents of lengths drawn between n/16 and n/4 (seeded)."""
    g = torch.Generator().manual_seed(0)
    ids, doc, at = torch.empty(n, dtype=torch.long), 0, 0
    while at < n:
        length = int(torch.randint(n // 16, n // 4 + 1, (1,), generator=g))
        ids[at:at + length] = doc
        at, doc = at + length, doc + 1
    return ids.to(device)


def _cases(n: int, device: torch.device) -> dict:
    """name -> (attnkit keyword arguments, Flex mask_mod, Flex score_mod or None). The Flex mods are written
    here as a Flex user writes them, apart from attnkit's."""
    docs = _documents(n, device)
    slopes = scores.alibi_slopes(H, device=device)
    global_idx = torch.arange(GLOBALS, device=device) * (n // GLOBALS)
    is_global = torch.zeros(n, dtype=torch.bool, device=device)
    is_global[global_idx] = True

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)

    def documents(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx)

    def longformer(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() <= LONGFORMER) | is_global[q_idx] | is_global[kv_idx]

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    return {
        "causal": ({"is_causal": True}, causal, None),
        f"window {WINDOW}, causal": ({"window": (WINDOW, 0)}, window, None),
        "documents, causal": ({"is_causal": True, "mask_mod": masks.document_mod(docs)}, documents, None),
        f"Longformer ±{LONGFORMER}, {GLOBALS} global":
            ({"mask_mod": masks.global_tokens_mod(LONGFORMER, global_idx)}, longformer, None),
        "ALiBi, causal": ({"is_causal": True, "score_mod": scores.alibi(slopes)}, causal, alibi),
        f"soft cap {SOFTCAP:g}, causal": ({"is_causal": True, "score_mod": scores.softcap(SOFTCAP)}, causal, softcap),
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


def _dense(mask_mod, n: int, device: torch.device) -> torch.Tensor:
    """The mask as a dense bool ``[n, n]``, for SDPA."""
    i = torch.arange(n, device=device)
    return mask_mod(0, 0, i[:, None], i[None, :])


def _kernels(n: int, rounds: int, device: torch.device, say, compiled: dict) -> list[list]:
    """The kernel rows at length ``n``: each case forward, then forward+backward (``compiled``: see
    :func:`_flex_for`)."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device=device, dtype=DTYPE, generator=g).requires_grad_() for _ in range(3))
    rows = []
    for name, (kw, mask_mod, score_mod) in _cases(n, device).items():
        say(f"{name}, n = {n}")
        try:
            rows += _kernel_rows(name, n, kw, mask_mod, score_mod, (q, k, v), rounds, device, compiled)
        except Exception as e:  # out of memory or a failed compile: said in the table, the run goes on
            rows.append([name, n, "-", f"failed: {_one_line(e)}", *["-"] * (len(KERNEL_HEADER) - 4)])
            say(f"  failed: {_one_line(e)}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _kernel_rows(name: str, n: int, kw: dict, mask_mod, score_mod, qkv: tuple, rounds: int,
                 device: torch.device, compiled: dict) -> list[list]:
    """One case's forward row and forward+backward row."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv
    make_block_mask, flex = _flex_for(name, compiled)
    block_mask = make_block_mask(mask_mod, None, None, n, n, device=device)
    _, plan_s = _timed(lambda: _attnkit_block_mask(q, k, v, kw), rounds, device)
    _, cbm_s = _timed(lambda: make_block_mask(mask_mod, None, None, n, n, device=device), rounds, device)
    dense = None if score_mod is not None else _dense(mask_mod, n, device)

    def sdpa_flash(a, b, c):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    with torch.no_grad():  # the two sides compute the same attention: their outputs, once
        diff = (attention(q, k, v, **kw).float()
                - flex(q, k, v, score_mod=score_mod, block_mask=block_mask).float()).abs().max().item()
    rows = []
    for backward in (False, True):
        first_ours, ours = _timed(_step(lambda a, b, c: attention(a, b, c, **kw), q, k, v, backward), rounds, device)
        with torch.set_grad_enabled(backward):  # named after a first call, which may have found the family
            chosen = which_backend(q, k, v, **kw)  # failing (its fallback then serves)
        first_theirs, theirs = _timed(
            _step(lambda a, b, c: flex(a, b, c, score_mod=score_mod, block_mask=block_mask), q, k, v, backward),
            rounds, device)
        flash = "-" if name != "causal" else _timed(_step(sdpa_flash, q, k, v, backward), rounds, device)[1] * 1e3
        with_mask = "-" if dense is None else _timed(
            _step(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense), q, k, v, backward),
            rounds, device)[1] * 1e3
        rows.append([name, n, "fwd+bwd" if backward else "fwd", chosen, ours * 1e3, theirs * 1e3,
                     f"{theirs / ours:.2f}x", flash, with_mask, plan_s * 1e3, cbm_s * 1e3,
                     f"{cbm_s / plan_s:.1f}x", f"{first_ours:.1f} / {first_theirs:.1f}", diff])
    return rows


def _attnkit_block_mask(q, k, v, kw: dict):
    """The mask worked out from scratch: a new ``attnkit.mask_plan`` and the flex backend's BlockMask from it."""
    plan = mask_plan(kw.get("mask_mod"), q_len=q.shape[-2], is_causal=kw.get("is_causal", False),
                     window=kw.get("window"), device=q.device)
    with torch.no_grad():
        return flex_backend._inputs(validate_call(q, k, v, mask=plan), flex_backend.BLOCK_SIZE).args[4]


def _models(n: int, rounds: int, device: torch.device, say) -> list[list]:
    """The model rows at length ``n``: Llama-style and Mistral-style prefill under each implementation."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers

        from ..integrations import transformers as _registers_attnkit  # noqa: F401
    except ImportError as e:
        return [["-", n, "-", f"not measured: transformers could not be imported ({e})", *["-"] * 4]]
    rows = []
    for label, make in ((f"Llama-style, {MODEL['num_hidden_layers']} layers",
                         lambda: transformers.LlamaModel(transformers.LlamaConfig(**MODEL, max_position_embeddings=n))),
                        (f"Mistral-style, window {WINDOW}",
                         lambda: transformers.MistralModel(transformers.MistralConfig(
                             **MODEL, sliding_window=WINDOW, max_position_embeddings=n)))):
        rows += _model_rows(label, make, n, rounds, device, say)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _model_rows(label: str, make: Callable, n: int, rounds: int, device: torch.device, say) -> list[list]:
    """One model's rows, one per implementation."""
    torch.manual_seed(0)
    model = make().to(device=device, dtype=DTYPE).eval()
    ids = torch.randint(0, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    outs: dict[str, torch.Tensor] = {}
    got: dict[str, tuple | str] = {}

    def prefill():
        with torch.no_grad():
            return model(input_ids=ids).last_hidden_state

    for impl in IMPLEMENTATIONS:
        say(f"{label}, n = {n}, {impl}")
        try:
            model.set_attn_implementation(impl)
            with backends.served() as served:
                _sync(device)
                start = time.perf_counter()
                outs[impl] = prefill()
                _sync(device)
                first = time.perf_counter() - start
            got[impl] = first, _timed(prefill, rounds, device)[1], sorted(set(served))
        except Exception as e:  # a failed compile or out of memory: said in the table, the run goes on
            got[impl] = _one_line(e)
            say(f"  failed: {got[impl]}")
    base = got.get("sdpa")
    rows = []
    for impl in IMPLEMENTATIONS:
        if isinstance(got[impl], str):
            rows.append([label, n, impl, f"failed: {got[impl]}", "-", "-", "-", "-"])
            continue
        first, t, served = got[impl]
        speed = f"{base[1] / t:.2f}x" if isinstance(base, tuple) else "-"
        diff = (outs[impl].float() - outs["sdpa"].float()).abs().max().item() if "sdpa" in outs else "-"
        rows.append([label, n, impl, ", ".join(served) or "-", t * 1e3, speed, f"{first:.1f}", diff])
    return rows


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def steps(quick: bool) -> list[tuple[str, int]]:
    """The run's steps in order, shortest first, so that a run stopped early has the most of every kind: at
    each length the models (where they are measured: a few compiles), then the kernels (about two dozen
    compiles at the first length: every case, both passes, on both sides)."""
    if quick:
        return [("models", QUICK_SIZE), ("kernels", QUICK_SIZE)]
    return [(kind, n) for n in SIZES for kind in ("models", "kernels") if kind == "kernels" or n in MODEL_SIZES]


def measure(plan: list[tuple[str, int]], rounds: int, device: torch.device, out_dir: Path, command: str) -> str:
    """Run ``plan``'s steps on ``device``, writing ``out_dir/gpu.md`` after each; return the last text."""
    say = progress("gpu")
    kernel_rows: list[list] = []
    model_rows: list[list] = []
    compiled: dict = {}
    text = ""
    for done, (kind, n) in enumerate(plan, 1):
        if kind == "kernels":
            kernel_rows += _kernels(n, rounds, device, say, compiled)
        else:
            model_rows += _models(n, min(rounds, MODEL_ROUNDS), device, say)
        text = write_report(out_dir, "gpu", "attnkit on a CUDA GPU", _body(device, kernel_rows, model_rows,
                                                                           plan[done:]), command)
    return text


def _body(device: torch.device, kernel_rows: list[list], model_rows: list[list], left: list) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} (a smoke run)"
    text = (f"{name}, B = {B}, H = {H}, head dim {D}, bfloat16. Medians of synchronised runs after a first "
            "call, which compiles where the sizes are new to the kernel (its time is in the first-call column; both "
            "sides compile for a case's first sizes, then once more with the lengths as variables). "
            "\"attnkit speed / Flex's\" is Flex's time over "
            "attnkit's (above 1: attnkit is faster); the plan columns time the mask worked out from scratch: a new "
            "attnkit.mask_plan and the flex backend's BlockMask from it, against create_block_mask.\n\n"
            + markdown_table(KERNEL_HEADER, kernel_rows))
    if model_rows:
        text += ("\n\n## Model prefill\n\ntransformers models with random weights from a seeded config "
                 f"({MODEL['num_hidden_layers']} layers, hidden size {MODEL['hidden_size']}, "
                 f"{MODEL['num_attention_heads']} heads over {MODEL['num_key_value_heads']} key heads), in "
                 "bfloat16, without the language-model head: one prefill without gradient, and its last hidden "
                 "state's largest difference from sdpa's. \"speed / sdpa's\" is sdpa's time over the "
                 "implementation's.\n\n" + markdown_table(MODEL_HEADER, model_rows))
    if left:
        text += ("\n\nNot measured (the run stopped before them): "
                 + ", ".join(f"{kind} at n = {n}" for kind, n in left) + ".")
    return text


def run(quick: bool, out_dir: Path) -> str:
    """Measure, write ``out_dir/gpu.md`` (after every step) and return the table.

    Raises:
        CannotMeasure: no CUDA device (one line: the command needs one).
    """
    if not torch.cuda.is_available():
        raise CannotMeasure("no CUDA device: attnkit bench gpu measures attnkit on a CUDA GPU "
                         "(torch.cuda.is_available() is False here)")
    return measure(steps(quick), QUICK_ROUNDS if quick else ROUNDS, torch.device("cuda"), out_dir,
                   "attnkit bench gpu" + (" --quick" if quick else ""))
