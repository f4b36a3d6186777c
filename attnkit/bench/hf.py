"""Hugging Face suite: whole transformers models with attn_implementation "attnkit" against "sdpa"
and "eager", random weights from configs built in code (no download).

The question it answers: how much of a model's prefill (and forward+backward) does attnkit's
attention change, end to end, for a Mistral-style model (sliding window 512), a Gemma 2-style
model (soft-capping, alternating local/global layers; transformers 5.24 refuses "sdpa" for Gemma2Model, so
eager is its anchor) and a T5-style encoder (a learned relative position bias per head, which the model hands
every layer as a dense ``[1, H, n, n]`` tensor: attnkit reads it as one bias per diagonal, sdpa takes it as a
float mask)? Targets: Mistral >= 2x sdpa, Gemma 2 >= 1.5x eager and sdpa, at n = 8192 (forward+backward at
4096).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ._util import interleaved_medians, markdown_table, write_report


def _mistral(layers: int):
    import transformers
    config = transformers.MistralConfig(
        vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, sliding_window=512, max_position_embeddings=16384)
    return transformers.MistralModel(config)


def _gemma2(layers: int):
    import transformers
    config = transformers.Gemma2Config(
        vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, sliding_window=512,
        attn_logit_softcapping=50.0, max_position_embeddings=16384)
    return transformers.Gemma2Model(config)


def _t5_encoder(layers: int):
    import transformers
    config = transformers.T5Config(
        vocab_size=1000, d_model=512, d_kv=64, d_ff=1024, num_layers=layers, num_heads=8,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0)
    return transformers.T5EncoderModel(config)


def _forward(model, impl, ids, backward=False):
    def run():
        model.set_attn_implementation(impl)
        if backward:
            model(input_ids=ids).last_hidden_state.sum().backward()
        else:
            with torch.no_grad():
                model(input_ids=ids)
    return run


def _attention_share(model, impl, ids) -> float:
    """The share of one no-grad forward spent inside the attention calls (mask building apart),
    measured through a timed copy of ``impl`` registered under another name."""
    import sys
    import time

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = (sys.modules[type(model).__module__].eager_attention_forward if impl == "eager"
             else ALL_ATTENTION_FUNCTIONS[impl])
    spent = [0.0]

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    name = f"{impl}-timed"
    AttentionInterface.register(name, timed)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    model.set_attn_implementation(name)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids)
    return spent[0] / (time.perf_counter() - t0)


HEADER = ["model", "pass", "n", "layers", "impl", "ms", "attnkit speed-up", "attention share"]


def run(quick: bool, out_dir: Path) -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")

    layers = 2 if quick else 8
    n_fwd, n_bwd = (1024, 512) if quick else (8192, 4096)
    repeat = 3
    torch.manual_seed(0)
    rows = []
    cases = [("Mistral", _mistral, "prefill", n_fwd, ["attnkit", "sdpa"]),
             ("Mistral", _mistral, "fwd+bwd", n_bwd, ["attnkit", "sdpa"]),
             ("Gemma 2", _gemma2, "prefill", n_fwd, ["attnkit", "eager"]),
             ("T5 encoder", _t5_encoder, "prefill", n_bwd, ["attnkit", "sdpa", "eager"])]
    for name, build, kind, n, impls in cases:
        model = build(layers).eval()
        ids = torch.randint(0, 1000, (1, n))
        fns = {impl: _forward(model, impl, ids, backward=kind == "fwd+bwd") for impl in impls}
        t = interleaved_medians(fns, repeat=repeat, alternate=True)
        for impl in impls:
            share = f"{_attention_share(model, impl, ids):.0%}" if kind == "prefill" else "-"
            rows.append([name, kind, n, layers, impl, round(t[impl] * 1e3, 1),
                         round(t[impl] / t["attnkit"], 2), share])
            print("  ", rows[-1], flush=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    body = ("Medians of 3 interleaved runs. Attention share: the time inside the attention calls of one more "
            "prefill, through a timed copy of the implementation (mask building excluded).\n\n"
            + markdown_table(HEADER, rows) + f"\n\nLoad averages after the run: {load}. "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}.\n")
    return write_report(out_dir, "hf", "attnkit inside Hugging Face transformers", body,
                        f"python -m attnkit.bench hf{' --quick' if quick else ''}")
