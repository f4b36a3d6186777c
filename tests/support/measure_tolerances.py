"""Measure the float32 error of attnkit's parity paths, to set the float32 parity rows of ``tolerances.py``.

A float32 parity check compares two implementations whose operation orders differ, so their
difference depends on the CPU (AVX512 / AVX2 / no vector unit), the BLAS blocking and the thread
count. This program runs every kind of float32 comparison the suite makes (whole models against
transformers, modules against torch.nn, cached decoding against a full pass) over many seeds, with
1 and 2 threads, and compares each float32 result with the same computation in float64. It prints,
per family, the worst of

* ``pair``: ``|ours32 - theirs32|``, what a test sees on this machine;
* ``bound``: ``|ours32 - truth64| + |theirs32 - truth64|``, what the two may differ by where their
  rounding errors do not cancel (another CPU);
* ``rel``: ``bound / max |truth64|`` per case, the error relative to the size of the result. Rounding
  error builds up with the size of the whole computation, not of each element, so this is the figure
  the float32 parity rows scale with (``close(..., scaled_atol=...)``).

Run it under each CPU dispatch level torch offers, and set the rows from the worst::

    for cap in "" avx2 default; do ATEN_CPU_CAPABILITY=$cap python -m tests.support.measure_tolerances; done

It takes about a minute and needs transformers (and sentence-transformers for the embedding case).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import copy  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

SEEDS = range(8)
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ours32, theirs32, truth64


def _gpt2_cases() -> Iterator[Case]:
    from attnkit.models import GPT2
    from tests.models.test_gpt2 import _hf_gpt2

    variants = [{}, {"activation_function": "relu", "n_inner": 48, "scale_attn_by_inverse_layer_idx": True},
                {"scale_attn_weights": False, "layer_norm_epsilon": 1e-3}]
    for seed in SEEDS:
        for over in variants:
            hf = _hf_gpt2(seed=seed, dtype=torch.float32, **over)
            ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(seed))
            yield GPT2.from_hf(hf)(ids).logits, hf(ids).logits, copy.deepcopy(hf).double()(ids).logits


def _bert_cases() -> Iterator[Case]:
    import transformers

    from attnkit.models import Bert, Tokenizer, bundled_model_dir
    from tests.models.test_bert import SENTENCES

    path = str(bundled_model_dir())
    theirs = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    enc = Tokenizer.from_pretrained()(SENTENCES)
    ours = Bert.from_pretrained()
    truth = copy.deepcopy(theirs).double()(**enc).last_hidden_state
    yield ours(**enc).last_hidden_state, theirs(**enc).last_hidden_state, truth
    for seed in SEEDS:
        cfg = transformers.BertConfig(vocab_size=97, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                                      intermediate_size=40, max_position_embeddings=33, type_vocab_size=3,
                                      hidden_act="gelu_new", layer_norm_eps=1e-7)
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        hf = transformers.BertModel(cfg).eval()
        ids = torch.randint(0, 97, (3, 11))
        am = (torch.arange(11) < torch.tensor([[11], [7], [2]])).long()
        yield (Bert.from_hf(hf)(ids, attention_mask=am).last_hidden_state, hf(ids, attention_mask=am).last_hidden_state,
               copy.deepcopy(hf).double()(ids, attention_mask=am).last_hidden_state)


def _sentence_embedding_cases() -> Iterator[Case]:
    import sentence_transformers

    from attnkit.models import Bert, bundled_model_dir
    from tests.models.test_bert import SENTENCES

    texts = SENTENCES + [" ".join(["the river bank"] * 150)]
    st = sentence_transformers.SentenceTransformer(str(bundled_model_dir()), device="cpu")
    ref = st.encode(texts, convert_to_tensor=True)
    truth = st.double().encode(texts, convert_to_tensor=True)
    yield Bert.from_pretrained().encode(texts, batch_size=3), ref, truth


def _transformer_cases() -> Iterator[Case]:
    from attnkit.modules import Transformer, TransformerDecoderLayer, TransformerEncoderLayer
    from tests.modules.test_transformer import FF, E, H, _randomise_norms

    for seed in SEEDS:
        for norm_first in (False, True):
            torch.manual_seed(seed)
            enc = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
            dec = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
            full = nn.Transformer(E, H, 2, 2, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
            full.encoder.enable_nested_tensor = False
            for m in (enc, dec, full):
                _randomise_norms(m)
            x, mem = torch.randn(3, 7, E), torch.randn(3, 9, E)
            yield (TransformerEncoderLayer.from_torch(enc)(x), enc(x),
                   TransformerEncoderLayer.from_torch(enc).double()(x.double()))
            yield (TransformerDecoderLayer.from_torch(dec)(x, mem, is_causal=False), dec(x, mem),
                   copy.deepcopy(dec).double()(x.double(), mem.double()))
            causal = torch.ones(7, 7, dtype=torch.bool).triu(1)  # torch: True = not allowed; ours: causal default
            yield (Transformer.from_torch(full)(mem, x), full(mem, x, tgt_mask=causal),
                   copy.deepcopy(full).double()(mem.double(), x.double(), tgt_mask=causal))


def _mha_cases() -> Iterator[Case]:
    from tests.modules.test_attention import torch_pair

    for seed in SEEDS:
        for kw in ({"embed_dim": 32, "num_heads": 8}, {"embed_dim": 24, "num_heads": 3, "bias": False},
                   {"embed_dim": 16, "num_heads": 4, "kdim": 10, "vdim": 6}):
            theirs, ours = torch_pair(seed, dtype=torch.float32, **kw)
            e = kw["embed_dim"]
            q, k, v = torch.randn(3, 5, e), torch.randn(3, 7, kw.get("kdim", e)), torch.randn(3, 7, kw.get("vdim", e))
            truth = copy.deepcopy(theirs).double()(q.double(), k.double(), v.double())[0]
            yield ours(q, k, v), theirs(q, k, v)[0], truth


def _cached_decoding_cases() -> Iterator[Case]:
    """Our own float32 cached decoding against our own float32 full pass (different matmul shapes)."""
    from attnkit.models import GPT2
    from tests.models.test_gpt2 import _hf_gpt2

    for seed in SEEDS:
        for init in (0.02, 0.5):
            gpt = GPT2.from_hf(_hf_gpt2(seed=seed, dtype=torch.float32, initializer_range=init))
            ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(seed))
            cache = gpt.make_cache(2, 9)
            steps = [gpt(ids[:, :4], cache=cache).logits] + [gpt(ids[:, t:t + 1], cache=cache).logits
                                                             for t in range(4, 9)]
            yield torch.cat(steps, 1), gpt(ids).logits, copy.deepcopy(gpt).double()(ids).logits


def _kernel_cases() -> Iterator[Case]:
    """The float32 kernel comparisons of test_blockwise*.py and test_attention.py: blockwise against SDPA."""
    import torch.nn.functional as F

    from attnkit import backends, masks
    from attnkit.call import validate_call

    for seed in SEEDS:
        for n, d, window, band in ((70, 16, (9, 4), True), (333, 32, (50, 7), False), (1024, 16, (100, 100), True)):
            g = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(1, 4, n, d, generator=g) for _ in range(3))
            mask = masks.sliding_window(n, left=window[0], right=window[1])
            ours = backends.get("band" if band else "fused_tiles")(validate_call(q, k, v, window=window))[0]
            truth = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
            yield ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), truth


FAMILIES: dict[str, Callable[[], Iterator[Case]]] = {
    "kernels (blockwise vs SDPA, the float32 row)": _kernel_cases,
    "models (GPT2 logits vs transformers)": _gpt2_cases,
    "models (BERT hidden states vs transformers)": _bert_cases,
    "models (sentence embeddings vs sentence-transformers)": _sentence_embedding_cases,
    "models (cached decoding vs full pass, GPT2 logits)": _cached_decoding_cases,
    "modules (torch.nn.Transformer* layers)": _transformer_cases,
    "modules (torch.nn.MultiheadAttention)": _mha_cases,
}


@torch.no_grad()
def measure() -> dict[str, dict[str, float]]:
    """Worst ``pair``, ``bound`` and ``rel`` errors per family, over 1 and 2 threads."""
    threads = torch.get_num_threads()
    worst: dict[str, dict[str, float]] = {}
    try:
        for name, cases in FAMILIES.items():
            w = worst.setdefault(name, {"pair": 0.0, "bound": 0.0, "rel": 0.0, "cases": 0})
            for n in (1, 2):
                torch.set_num_threads(n)
                for ours, theirs, truth in cases():
                    ours, theirs = ours.double(), theirs.double()
                    w["pair"] = max(w["pair"], (ours - theirs).abs().max().item())
                    bound = ((ours - truth).abs() + (theirs - truth).abs()).max().item()
                    w["bound"] = max(w["bound"], bound)
                    w["rel"] = max(w["rel"], bound / truth.abs().max().item())
                    w["cases"] += 1
    finally:
        torch.set_num_threads(threads)
    return worst


if __name__ == "__main__":
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for family, w in measure().items():
        print(f"{family:56s} cases {w['cases']:3d}  pair {w['pair']:.2e}  bound {w['bound']:.2e}  "
              f"rel {w['rel']:.2e}")
