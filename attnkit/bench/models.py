"""Benchmark suite ``models``: real models on attnkit against ``transformers``, same run, same weights.

* BERT (the bundled MiniLM, 6 layers, 384 wide) forward on 32 x 128 tokens: attnkit's ``Bert``
  against ``transformers``' ``BertModel`` with SDPA attention (target: at most 1.1x its time),
  with and without padding; and with attention weights against ``BertModel`` eager.
* GPT-2 (a random 4-layer, 256-wide model): greedy generation with the static KV cache against
  the uncached loop and ``transformers``' ``generate``.
* Sentence embeddings of a corpus: ``Bert.encode`` against ``SentenceTransformer.encode`` on the
  same MiniLM, 2,000 sentences of real prose of real, mixed lengths: the docstrings of Python's
  standard library (:func:`docstring_sentences`, shipped with Python; target: >= 1.5x its
  sentences per second, cosine >= 0.99999 per sentence).

Candidates and anchors are timed interleaved (one call each per round, median over rounds), so
load from other processes hits both alike. The machine's matmul throughput is the physical anchor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ._util import attention_flops, interleaved_medians, markdown_table, matmul_gflops, progress, write_report


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per function: one warm-up call each, then ``rounds`` rounds in alternating order."""
    return interleaved_medians(fns, repeat=rounds, warmup=1, alternate=True)


def _bert_flops(cfg, batch: int, length: int) -> float:
    e, f, n = cfg.hidden_size, cfg.intermediate_size, batch * length
    linear = 2.0 * n * (4 * e * e + 2 * e * f) * cfg.num_hidden_layers
    attn = attention_flops(length, length, e // cfg.num_attention_heads, cfg.num_attention_heads, batch)
    return linear + attn * cfg.num_hidden_layers


def _bert_rows(quick: bool) -> tuple[list[list[object]], list[str]]:
    import transformers

    from ..models import Bert, bundled_model_dir

    folder = str(bundled_model_dir())
    ours = Bert.from_pretrained(folder)
    hf_sdpa = transformers.BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    hf_eager = transformers.BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    batch, length = (8, 64) if quick else (32, 128)
    rounds = 3 if quick else 10
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, ours.config.vocab_size, (batch, length), generator=g)
    full = torch.ones_like(ids)
    padded = full.clone()
    for i in range(batch):  # lengths from L/2 to L: a realistic padded batch
        padded[i, length // 2 + (i * length // 2) // batch:] = 0
    flops = _bert_flops(ours.config, batch, length)
    rows, notes = [], []
    with torch.inference_mode():
        for label, mask in (("no padding", full), ("padded (L/2..L)", padded)):
            t = _interleaved({"ours": lambda m=mask: ours(ids, attention_mask=m),
                              "hf": lambda m=mask: hf_sdpa(ids, attention_mask=m)}, rounds)
            rows.append([f"BERT forward {batch}x{length}, {label}", "transformers BertModel sdpa",
                         t["ours"] * 1e3, t["hf"] * 1e3, t["ours"] / t["hf"], flops / t["ours"] / 1e9])
        t = _interleaved({"ours": lambda: ours(ids, attention_mask=padded, output_attentions=True),
                          "hf": lambda: hf_eager(ids, attention_mask=padded, output_attentions=True)}, rounds)
        rows.append([f"BERT forward {batch}x{length}, padded, with weights", "transformers BertModel eager",
                     t["ours"] * 1e3, t["hf"] * 1e3, t["ours"] / t["hf"], flops / t["ours"] / 1e9])
        o = ours(ids, attention_mask=padded).last_hidden_state
        r = hf_sdpa(ids, attention_mask=padded).last_hidden_state
        notes.append(f"BERT outputs agree: max |attnkit - transformers| = {(o - r).abs().max().item():.2e}.")
    return rows, notes


def _gpt2_rows(quick: bool) -> tuple[list[list[object]], list[str]]:
    import transformers

    from ..models import GPT2

    prompt, new = (16, 16) if quick else (128, 64)
    cfg = transformers.GPT2Config(vocab_size=5000, n_positions=512, n_embd=256, n_layer=4, n_head=8,
                                  initializer_range=0.5, bos_token_id=4999, eos_token_id=4999)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    ours = GPT2.from_hf(hf)
    ids = torch.randint(0, 4999, (4, prompt), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    rounds = 2 if quick else 6
    fns = {"cached": lambda: ours.generate(ids, new, use_cache=True),
           "compiled": lambda: ours.generate(ids, new, compile=True),
           "uncached": lambda: ours.generate(ids, new, use_cache=False),
           "hf": lambda: hf.generate(ids, attention_mask=am, max_new_tokens=new, do_sample=False, min_new_tokens=new)}
    with torch.inference_mode():
        same = torch.equal(fns["cached"](), fns["hf"]())
        started = time.perf_counter()
        same_compiled = torch.equal(fns["compiled"](), fns["cached"]())  # the first call compiles the step
        compile_s = time.perf_counter() - started
        t = _interleaved(fns, rounds)
    label = f"GPT-2 (4x256) greedy, 4 x {prompt} prompt + {new} tokens"
    rows = [[label + ", KV cache", "attnkit, no cache", t["cached"] * 1e3, t["uncached"] * 1e3,
             t["cached"] / t["uncached"], ""],
            [label + ", KV cache", "transformers generate (sdpa, DynamicCache)", t["cached"] * 1e3, t["hf"] * 1e3,
             t["cached"] / t["hf"], ""],
            [label + ", KV cache, compile=True", "transformers generate (sdpa, DynamicCache)", t["compiled"] * 1e3,
             t["hf"] * 1e3, t["compiled"] / t["hf"], ""]]
    return rows, [f"GPT-2 greedy tokens identical to transformers' generate: {same}; with compile=True identical to "
                  f"without: {same_compiled} (its first call, which compiles the step: {compile_s:.0f} s)."]


#: Standard-library modules whose docstrings make the corpus (those that import here, in this order).
CORPUS_MODULES = (
    "json os re collections functools itertools pathlib subprocess typing argparse logging email http urllib "
    "unittest asyncio datetime decimal fractions statistics random string textwrap threading socket sqlite3 csv "
    "zipfile tarfile shutil tempfile pickle copy heapq bisect enum dataclasses contextlib abc io codecs locale "
    "gettext calendar time math operator inspect ast dis tokenize pdb timeit trace gc weakref types queue sched "
    "selectors signal hashlib hmac secrets base64 struct pprint reprlib difflib html configparser platform "
    "sysconfig warnings traceback linecache glob fnmatch filecmp uuid ipaddress mailbox mimetypes smtplib "
    "imaplib ftplib wave colorsys doctest runpy importlib pkgutil modulefinder compileall keyword token "
    "symtable code codeop shelve gzip bz2 lzma zlib optparse getopt fileinput numbers graphlib "
    "concurrent.futures multiprocessing").split()


def docstring_sentences(n: int) -> list[str]:
    """``n`` distinct sentences (3 words or more) from the docstrings of :data:`CORPUS_MODULES` and
    their public functions and classes, in a fixed order: English prose of the lengths people write."""
    import importlib
    import inspect
    import re

    out: list[str] = []
    seen: set[str] = set()
    for name in CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for obj in [module] + [getattr(module, a, None) for a in sorted(dir(module)) if not a.startswith("_")]:
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)):
                continue
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join((inspect.getdoc(obj) or "").split())):
                if len(sentence.split()) >= 3 and sentence not in seen and not sentence.startswith(">>>"):
                    seen.add(sentence)
                    out.append(sentence)
                    if len(out) == n:
                        return out
    return out


def _encode_rows(quick: bool) -> tuple[list[list[object]], list[str]]:
    from sentence_transformers import SentenceTransformer

    from ..models import Bert, bundled_model_dir

    texts = docstring_sentences(200 if quick else 2000)
    ours = Bert.from_pretrained()
    theirs = SentenceTransformer(str(bundled_model_dir()), device="cpu")
    with torch.inference_mode():
        t = _interleaved({"ours": lambda: ours.encode(texts, show_progress=False),
                          "theirs": lambda: theirs.encode(texts, batch_size=32, convert_to_tensor=True,
                                                          show_progress_bar=False)}, 1 if quick else 3)
        cos = (ours.encode(texts, show_progress=False) * theirs.encode(texts, batch_size=32, convert_to_tensor=True,
                                                                        show_progress_bar=False)).sum(-1)
    words = sorted(len(x.split()) for x in texts)
    rows = [[f"Bert.encode, {len(texts)} sentences of the standard library's docstrings",
             "SentenceTransformer.encode (batch 32)", t["ours"] * 1e3, t["theirs"] * 1e3, t["ours"] / t["theirs"], ""]]
    rate, anchor = len(texts) / t["ours"], len(texts) / t["theirs"]
    return rows, [f"Sentence embeddings: {rate:.0f} sentences/s against {anchor:.0f} "
                  f"({t['theirs'] / t['ours']:.2f}x); lowest cosine {cos.min().item():.7f}; words per sentence: "
                  f"median {words[len(words) // 2]}, max {words[-1]}."]


def run(quick: bool, out_dir: Path) -> str:
    """Measure, print and write ``out_dir/models.md``; return the report."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    say = progress("models")
    say("matmul anchor, then BERT (MiniLM) against transformers")
    peak_before = matmul_gflops()
    bert_rows, notes = _bert_rows(quick)
    say("GPT-2 greedy generation against transformers' generate")
    gpt_rows, gpt_notes = _gpt2_rows(quick)
    say("sentence embeddings against sentence-transformers")
    enc_rows, enc_notes = _encode_rows(quick)
    peak_after = matmul_gflops()
    header = ["case", "anchor", "attnkit ms (median)", "anchor ms (median)", "ratio (attnkit / anchor)",
              "attnkit GFLOP/s"]
    body = (
        markdown_table(header, bert_rows + gpt_rows + enc_rows)
        + f"\n\nMatmul anchor (float32, 2048^2): {peak_before:.0f} GFLOP/s before the run, {peak_after:.0f} "
        "after; when the two differ, other processes were loading the machine, which is why only "
        "ratios of interleaved timings are meaningful here. Ratio < 1 means attnkit is faster; the BERT "
        "target is <= 1.1x transformers' SDPA path. Timings are medians of interleaved rounds (one call "
        "of each per round), float32, inference mode, same weights.\n\n"
        + "\n".join(f"- {n}" for n in notes + gpt_notes + enc_notes)
    )
    cmd = "attnkit bench models" + (" --quick" if quick else "")
    return write_report(out_dir, "models", "Real models: attnkit against transformers", body, cmd)
