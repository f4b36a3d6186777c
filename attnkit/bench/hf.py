"""Hugging Face suite: a matrix of real model families with attn_implementation "attnkit" against "sdpa" and
"eager" in the same run, random weights from configs built in code (no download).

Each family keeps its real attention shape (query and key/value heads, head size, window, soft-cap, local and
global layers, context length) at a tiny width elsewhere (a small vocabulary and MLP, few layers), so that
attention is most of what is timed in most cells (the table's `attention share` says how much). Cells: prefill
(the whole prompt in one forward) and decode (one token per step through a ``DynamicCache`` already holding ``n``
tokens, with the 2-D attention mask and position ids ``generate`` passes), batch 1 and a left-padded batch of 8,
float32 and bfloat16. The question each cell answers: how much faster (above 1) or slower (below 1) a model runs
with ``"attnkit"`` than with ``"sdpa"`` (eager where transformers offers no SDPA path: Gemma 2), end to end, and
its attention alone.

Times are CPU time on one thread (``torch.set_num_threads(1)``, ``time.process_time``): a shared machine's
other load then does not count against whichever implementation it meets. ``--quick`` runs a few tiny cells
and checks attnkit's logits against the anchor's within the tolerance table (``tests/bench``).
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import _cpu
from ._util import interleaved_medians, markdown_table, progress, write_report

VOCAB = 256
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
LENGTHS = (512, 2048, 8192)
PADDED_BATCH = 8
#: Decode steps timed per cell (prefill rounds: 5 below n = 2048): a step over a long cache is memory-bound and moves
#: with the machine's other load, and a cell at parity (BERT's prefill, served by SDPA under both names) fell below
#: 0.97 or rose above it by chance from one run of the matrix to the next with fewer.
DECODE_STEPS = 15
#: Eager materialises the scores [B, H, n, n]: a cell whose scores would pass this many bytes is not run eager.
EAGER_SCORES_MAX = 1 << 28


@dataclass(frozen=True)
class Family:
    """One model family: how to build it (``layers`` deep), its context, whether it decodes, its anchor."""

    name: str
    shape: str  # the attention shape, for the table
    build: object  # (dtype) -> model
    context: int
    decoder: bool
    anchor: str = "sdpa"  # Gemma 2 has no SDPA path in transformers
    windowed: bool = False
    heads: int = 0


def _llama(dtype):
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, pad_token_id=0)).to(dtype)


def _mistral(dtype):
    import transformers
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, sliding_window=4096, max_position_embeddings=32768,
        pad_token_id=0)).to(dtype)


def _qwen2(dtype):
    import transformers
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=32768, pad_token_id=0)).to(dtype)


def _gemma2(dtype):
    import transformers
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=256, max_position_embeddings=8192,
        pad_token_id=0)).to(dtype)


def _phi(dtype):
    import transformers
    return transformers.PhiForCausalLM(transformers.PhiConfig(
        vocab_size=VOCAB, hidden_size=2560, intermediate_size=64, num_hidden_layers=1, num_attention_heads=32,
        max_position_embeddings=2048, partial_rotary_factor=0.4, pad_token_id=0)).to(dtype)


def _gpt2(dtype):
    import transformers
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=768, n_inner=64, n_layer=1, n_head=12, n_positions=1024,
        pad_token_id=0)).to(dtype)


def _bert(dtype):
    import transformers
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=768, intermediate_size=64, num_hidden_layers=1, num_attention_heads=12,
        max_position_embeddings=512, pad_token_id=0), add_pooling_layer=False).to(dtype)


def _modernbert(dtype):
    import transformers
    return transformers.ModernBertModel(transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=768, intermediate_size=64, num_hidden_layers=3, num_attention_heads=12,
        local_attention=128, global_attn_every_n_layers=3, max_position_embeddings=8192, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)).to(dtype)


FAMILIES = (
    Family("Llama 3 (8B)", "32/8 heads, D 128", _llama, 8192, True, heads=32),
    Family("Mistral (7B)", "32/8 heads, D 128, window 4096", _mistral, 32768, True, windowed=True, heads=32),
    Family("Qwen2 (7B)", "28/4 heads, D 128", _qwen2, 32768, True, heads=28),
    Family("Gemma 2 (2B)", "8/4 heads, D 256, local 4096 + global, softcap 50", _gemma2, 8192, True,
           anchor="eager", windowed=True, heads=8),
    Family("Phi-2", "32 heads, D 80", _phi, 2048, True, heads=32),
    Family("GPT-2", "12 heads, D 64", _gpt2, 1024, True, heads=12),
    Family("BERT (base)", "12 heads, D 64, bidirectional", _bert, 512, False, heads=12),
    Family("ModernBERT (base)", "12 heads, D 64, local 128 + global every 3rd", _modernbert, 8192, False,
           windowed=True, heads=12),
)


def _batch(n: int, batch: int, seed: int):
    """Token ids ``[batch, n]`` and the 2-D mask: batch 1 unpadded; a batch of 8 left-padded, row ``i`` by
    ``i * n // 32`` tokens (none to 7/32 of the prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, n), generator=g)
    mask = torch.ones(batch, n, dtype=torch.long)
    if batch > 1:
        for i in range(batch):
            mask[i, : i * n // 32] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)  # what generate passes for a left-padded batch


def _prefill(model, ids, mask, decoder: bool):
    kw = {"input_ids": ids, "attention_mask": mask}
    if decoder:
        kw.update(position_ids=_positions(mask), use_cache=False)
    out = model(**kw)
    return out.logits if decoder else out.last_hidden_state


def _cache_contents(model, batch: int, n: int, dtype, seed: int) -> list[tuple]:
    """Random keys and values ``[batch, Hkv, n, D]`` for every layer of ``model``, as a prefill of ``n`` tokens
    would leave in its cache (the values do not change the work of a step)."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [tuple(torch.randn(batch, heads, n, head_dim, generator=g).to(dtype) for _ in range(2))
            for _ in range(config.num_hidden_layers)]


def _filled_cache(model, contents):
    """A fresh ``DynamicCache`` for ``model`` holding ``contents`` (:func:`_cache_contents`), as ``generate``
    makes it (its sliding-window layers keep their window only)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(contents):
        cache.update(k, v, layer)
    return cache


def _step(model, cache, token, mask):
    return model(input_ids=token, attention_mask=mask, position_ids=_positions(mask)[:, -1:],
                 past_key_values=cache, use_cache=True).logits


def _set(model, impl):
    if model.config._attn_implementation != impl:
        model.set_attn_implementation(impl)


class _AttentionClock:
    """The CPU time a forward spends inside its attention functions: while installed (a ``with`` block), each of
    transformers' registered attention functions and the given model modules' ``eager_attention_forward`` (which
    their layers look up at every call) is wrapped to add its time to ``spent``. The model's time less this is what
    attention cannot change (projections, MLP, masks, the cache), so a cell can show both the whole forward's
    speed-up and the attention's own."""

    def __init__(self, *models: str):
        self.spent = 0.0
        self._models = models  # the modules (``type(model).__module__``) whose eager function is wrapped
        self._undo: list = []
        self._depth = 0  # an attention function that calls another is timed once

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.process_time() if self._depth == 1 else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.spent += time.process_time() - t0
        return timed

    def __enter__(self):
        import importlib

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        try:
            for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
                fn = ALL_ATTENTION_FUNCTIONS[name]
                ALL_ATTENTION_FUNCTIONS[name] = self._wrap(fn)  # a local override of the global registration
                self._undo.append(lambda name=name, fn=fn: _restore(ALL_ATTENTION_FUNCTIONS, name, fn))
            for path in self._models:
                module = importlib.import_module(path)
                fn = getattr(module, "eager_attention_forward", None)
                if fn is not None:
                    module.eager_attention_forward = self._wrap(fn)
                    self._undo.append(lambda module=module, fn=fn: setattr(module, "eager_attention_forward", fn))
        except BaseException:
            self.__exit__()  # what was wrapped is put back
            raise
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _restore(interface, name: str, fn) -> None:
    """``interface[name]`` back to ``fn``: the wrapper's local override dropped, and ``fn`` set again only if it
    was itself a local override (so a later global registration is not shadowed)."""
    del interface[name]
    if interface.get(name) is not fn:
        interface[name] = fn


def _timed(clock: _AttentionClock, run):
    """``run()``'s output, its CPU time and the part of it spent in attention functions."""
    clock.spent = 0.0
    t0 = time.process_time()
    out = run()
    return out, time.process_time() - t0, clock.spent


def _prefill_cell(model, impls, n, batch, family, repeat, clock, warmup=1):
    ids, mask = _batch(n, batch, seed=n + batch)
    times = {impl: [] for impl in impls}
    attention = {impl: [] for impl in impls}
    outs = {}
    with torch.no_grad():
        for r in range(repeat + warmup):  # the first rounds warm up
            for impl in (impls if r % 2 else impls[::-1]):
                _set(model, impl)
                out, t, a = _timed(clock, lambda: _prefill(model, ids, mask, family.decoder))
                if r >= warmup:
                    times[impl].append(t)
                    attention[impl].append(a)
                outs[impl] = out
    return _medians(times), _medians(attention), outs, mask


def _decode_cell(model, impls, n, batch, dtype, steps, clock):
    ids, mask = _batch(n + 1, batch, seed=n + batch + 1)
    token = ids[:, -1:]
    times = {impl: [] for impl in impls}
    attention = {impl: [] for impl in impls}
    outs = {}
    contents = _cache_contents(model, batch, n, dtype, seed=n)
    with torch.no_grad():
        for r in range(steps + 1):
            for impl in (impls if r % 2 else impls[::-1]):
                _set(model, impl)
                cache = _filled_cache(model, contents)  # built apart: not timed
                out, t, a = _timed(clock, lambda cache=cache: _step(model, cache, token, mask))
                if r:
                    times[impl].append(t)
                    attention[impl].append(a)
                outs[impl] = out
    return _medians(times), _medians(attention), outs, mask[:, -1:]


def _medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {impl: statistics.median(t) for impl, t in times.items()}


def _cells(quick: bool):
    """(family, phase, n, batch, dtype, note) for every cell of the matrix (or of the quick run)."""
    if quick:
        for family in FAMILIES:
            yield family, "prefill", 64, 2, torch.float32, ""
            if family.decoder:
                yield family, "decode", 64, 2, torch.float32, ""
        return
    for family in FAMILIES:
        for dtype in (torch.float32, torch.bfloat16):
            for batch in (1, PADDED_BATCH):
                for n in LENGTHS:
                    if n > family.context:
                        continue
                    # A prefill's attention grows with n^2: the long and batched prompts are kept to the families
                    # whose windows they measure, so that the whole matrix runs in minutes.
                    long_ok = family.windowed and dtype == torch.float32 and family.anchor != "eager"
                    if batch == 1 and (n < 8192 or long_ok):
                        yield family, "prefill", n, batch, dtype, ""
                    elif batch > 1 and n == 512:
                        yield family, "prefill", n, batch, dtype, ""
                    if family.decoder:
                        yield family, "decode", n, batch, dtype, ""


def _impls(family: Family, phase: str, n: int, batch: int, quick: bool = False) -> tuple[list[str], str]:
    impls = ["attnkit", family.anchor]
    note = ""
    if family.anchor != "eager" and not quick:
        if phase == "decode" and batch > 1:
            note = "eager not run (batch 8 decode: it copies the cache per query head)"
        elif batch * family.heads * (1 if phase == "decode" else n) * n * 4 > EAGER_SCORES_MAX:
            note = "eager not run (its scores would pass 256 MiB)"
        else:
            impls.append("eager")
    return impls, note


HEADER = ["model", "attention", "dtype", "batch", "phase", "n", "attnkit ms", "anchor", "anchor ms",
          "attnkit speed-up", "attention speed-up", "attention share", "eager speed-up", "attnkit tokens/s",
          "anchor tokens/s", "note"]


def measure(quick: bool, say=print) -> tuple[list[list], list[tuple]]:
    """Run the matrix (or the quick cells): ``(rows, outputs)``, a table row per cell and, per cell,
    ``(model, phase, attnkit's output, the anchor's, the 2-D mask of the positions it covers, dtype)``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)  # 5.x renames it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows, checks = [], []
    models: dict = {}
    try:
        for cell in _cells(quick):
            rows.append(_cell(cell, models, quick, checks))
            say(" | ".join(str(c) for c in rows[-1][:13]))
    finally:
        torch.set_num_threads(threads)
    return rows, checks


def _cell(cell, models: dict, quick: bool, checks: list) -> list:
    """The matrix's row for ``cell`` (:func:`_cells`); its outputs are appended to ``checks``."""
    family, phase, n, batch, dtype, _ = cell
    key = (family.name, dtype)
    if key not in models:
        models.clear()
        torch.manual_seed(0)
        models[key] = family.build(dtype).eval()
    model = models[key]
    impls, note = _impls(family, phase, n, batch, quick)
    with _AttentionClock(type(model).__module__) as clock:
        if phase == "prefill":
            repeat = 1 if quick else 5 if n < 2048 else 2 if n < 8192 else 1
            t, a, outs, mask = _prefill_cell(model, impls, n, batch, family, repeat, clock, warmup=int(n < 8192))
        else:
            t, a, outs, mask = _decode_cell(model, impls, n, batch, dtype, 1 if quick else DECODE_STEPS, clock)
    checks.append((family.name, phase, outs["attnkit"], outs[family.anchor], mask, dtype))
    tokens = batch * (1 if phase == "decode" else n)
    anchor = family.anchor
    eager = f"{t['eager'] / t['attnkit']:.2f}" if "eager" in t and anchor != "eager" else "-"
    attention = round(a[anchor] / a["attnkit"], 2) if a["attnkit"] > 0 else "-"
    return [family.name, family.shape, str(dtype).removeprefix("torch."), batch, phase, n,
            round(t["attnkit"] * 1e3, 2), anchor, round(t[anchor] * 1e3, 2), round(t[anchor] / t["attnkit"], 2),
            attention, f"{a[anchor] / t[anchor]:.0%}", eager,
            *(round(tokens / t[impl]) for impl in ("attnkit", anchor)), note]


DECODE_HEADER = ["dtype", "n", "heads", "D", "read K and V ms", "attnkit ms", "SDPA enable_gqa ms",
                 "attnkit / read", "SDPA / attnkit"]


def decode_step(quick: bool, say=print) -> list[list]:
    """One query against a cache of ``n`` tokens, the attention call alone: ``attnkit.attention`` (which checks
    the cache's finiteness in the same pass), PyTorch SDPA with ``enable_gqa`` (no check), and the anchor, one
    read of the keys and values (``k.sum()`` and ``v.sum()``); CPU time on one thread, medians of 15 rounds."""
    import torch.nn.functional as F

    import attnkit

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    g = torch.Generator().manual_seed(0)
    shapes = [(256, 32, 8, 64)] if quick else [(n, 32, 8, d) for n in (4096, 8192) for d in (64, 128)]
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for n, h, hkv, d in shapes:
                q = torch.randn(1, h, 1, d, generator=g).to(dtype)
                k, v = (torch.randn(1, hkv, n, d, generator=g).to(dtype) for _ in range(2))
                fns = {"read": lambda k=k, v=v: (k.sum(), v.sum()),
                       "attnkit": lambda q=q, k=k, v=v: attnkit.attention(q, k, v),
                       "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
                with torch.no_grad():
                    t = interleaved_medians(fns, repeat=3 if quick else 15, warmup=2, clock=time.process_time,
                                            alternate=True)
                rows.append([str(dtype).removeprefix("torch."), n, f"{h}/{hkv}", d, round(t["read"] * 1e3, 3),
                             round(t["attnkit"] * 1e3, 3), round(t["sdpa"] * 1e3, 3),
                             round(t["attnkit"] / t["read"], 2), round(t["sdpa"] / t["attnkit"], 2)])
                say("decode step alone: " + " | ".join(str(c) for c in rows[-1]))
    finally:
        torch.set_num_threads(threads)
    return rows


def run(quick: bool, out_dir: Path) -> str:
    say = progress("hf")
    have = [f for f in FLAGS if f in _cpu.flags()] or ["none of them (or unknown)"]
    say(f"CPU: {_cpu.name()}; flags: {', '.join(have)}")
    t0 = time.perf_counter()
    rows = measure(quick, say)[0]
    step = decode_step(quick, say)
    minutes = (time.perf_counter() - t0) / 60
    ratio = HEADER.index("attnkit speed-up")
    worst, best = min(rows, key=lambda r: r[ratio]), max(rows, key=lambda r: r[ratio])
    describe = lambda r: f"{r[0]}, {r[4]}, n = {r[5]}, batch {r[3]}, {r[2]}"  # noqa: E731
    summary = markdown_table(["cell", "which", "attnkit speed-up", "anchor"],
                             [["worst", describe(worst), worst[ratio], worst[7]],
                              ["best", describe(best), best[ratio], best[7]]])
    below = sum(r[ratio] < 0.97 for r in rows)
    body = (f"CPU: {_cpu.name()}; flags: {', '.join(have)}. One thread; CPU time (`time.process_time`), medians "
            f"of {'1' if quick else '5 prefill rounds (2 at n = 2048, 1 at 8192)'} and "
            f"{'1' if quick else f'{DECODE_STEPS} decode steps'}, after one warm-up round (none for a prefill "
            "at n = 8192: the family's shorter cells have run the same code), the implementations interleaved "
            "(the order reversed every other round). "
            "`attnkit speed-up` is the anchor's time over attnkit's (above 1: attnkit is faster); the anchor is "
            "`\"sdpa\"`, or `\"eager\"` where transformers has no SDPA path (Gemma 2). `attention speed-up` is the "
            "same ratio for the CPU time spent inside the attention functions alone (each registered attention "
            "function and the model's eager one timed as it is called), and `attention share` that time's share "
            "of the anchor's whole forward: the rest (projections, MLP, masks, the cache) is the same under "
            "every name, so no attention can make the model faster than 1 / (1 - share). Decode: one token per "
            "step through a `DynamicCache` holding `n` tokens, with the mask and position ids `generate` passes "
            "(tokens/s: the batch's new tokens per second; for a prefill, its prompt tokens). "
            "The batch of 8 is left-padded, row i by i/32 of the prompt. "
            "Prefill at n = 8192 runs only for the windowed families with an SDPA path (Mistral, ModernBERT) in "
            "float32, and batched prefill only at n = 512: the rest would take most of the run (or, for Gemma 2, "
            "whose only anchor is eager, several GiB of scores). A family's cells stop at its context length. "
            f"The whole matrix took {minutes:.1f} minutes.\n\n## Summary\n\n{summary}\n\n"
            f"Cells below 0.97 (slower than the anchor beyond noise): {below} of {len(rows)}.\n\n"
            f"## The matrix\n\n{markdown_table(HEADER, rows)}\n\n"
            "## A decode step alone\n\nOne query against a cache of n tokens (batch 1), the attention call alone: "
            "`attnkit.attention`, whose finiteness check rides in the same call, against reading the keys and "
            "values once (`k.sum()` and `v.sum()`, the memory traffic a step cannot avoid) and against PyTorch's "
            "SDPA with `enable_gqa=True` (which checks nothing); CPU time, one thread, medians of "
            f"{3 if quick else 15} interleaved rounds.\n\n{markdown_table(DECODE_HEADER, step)}\n\n"
            f"Load averages after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.\n")
    return write_report(out_dir, "hf", "attnkit inside Hugging Face transformers: a matrix of model families",
                        body, f"attnkit bench hf{' --quick' if quick else ''}", threads=1)
