"""What attention costs: FLOPs, score-matrix memory and parameters, from the shapes alone.

Conventions (the same as ``attnkit.bench``): a multiply-add counts as 2 FLOPs; only the matrix
products are counted (softmax, masking and scaling are O(n^2) and small next to them). For one
layer, batch ``B``, sequence ``n``, model width ``d``, ``h`` heads of width ``d / h``::

    projections  Q, K, V, O      4 * 2 * B * n * d * d
    scores       Q @ K^T         2 * B * h * n * n * (d / h) = 2 * B * n^2 * d
    mixing       P @ V           2 * B * n^2 * d             (both halved with a causal mask)
    score matrix                 B * h * n * n elements, if the backend materialises it

Splitting ``d`` into ``h`` heads changes neither the FLOPs nor the parameter count; it multiplies
the score matrix (and so the memory of a materialising backend) by ``h``.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
#: Backends that hold the whole ``[B, H, n, n]`` score matrix (the reference keeps the weights too).
MATERIALISING = ("reference", "naive", "math")
#: Backends that stream key/value tiles with an online softmax: one tile plus O(n) row statistics.
TILED = ("sdpa", "flash", "blockwise")


@dataclass(frozen=True)
class AttentionCost:
    """The cost of ``layers`` attention layers on one batch; see the module docstring for formulas."""

    n: int
    d: int
    heads: int
    layers: int
    batch: int
    dtype: str
    backend: str
    causal: bool
    bias: bool
    projection_flops: float
    attention_flops: float
    score_elements: int
    score_bytes: int
    peak_attention_bytes: int
    params: int

    @property
    def head_dim(self) -> int:
        return self.d // self.heads

    @property
    def total_flops(self) -> float:
        return self.projection_flops + self.attention_flops

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for printing."""
        per = " per layer" if self.layers > 1 else ""
        how = ("materialised" if self.backend in MATERIALISING
               else f"tiled by {self.backend}: one tile + row statistics")
        return [
            ("shape", f"batch {self.batch}, n {self.n}, d {self.d}, {self.heads} heads of {self.head_dim}, "
                      f"{self.layers} layer(s), {self.dtype}{', causal' if self.causal else ''}"),
            ("FLOPs, Q/K/V/O projections", f"{self.projection_flops:,.0f}  ({_si(self.projection_flops)})"),
            ("FLOPs, QK^T and PV", f"{self.attention_flops:,.0f}  ({_si(self.attention_flops)})"),
            ("FLOPs, total forward", f"{self.total_flops:,.0f}  ({_si(self.total_flops)})"),
            ("score matrix" + per, f"{self.score_elements:,} elements = {_bytes(self.score_bytes)}"),
            (f"attention memory{per} ({self.backend})", f"{_bytes(self.peak_attention_bytes)}  ({how})"),
            ("parameters, Q/K/V/O" + (" + biases" if self.bias else ""), f"{self.params:,}"),
        ]


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}FLOP"
    return f"{x:.3g} FLOP"


def _bytes(x: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x} B"


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def projection_params(d: int, heads: int = 1, *, out_proj: bool = True, bias: bool = False) -> int:
    """Parameters of the Q, K, V (and output) projections of one attention layer.

    Each of the ``heads`` heads owns ``3 * d * (d / heads)`` weights, so all heads together own
    ``3 * d * d`` whatever ``heads`` is; the output projection adds ``d * d``.

    Raises:
        ValueError: ``d`` is not divisible by ``heads``, or either is not positive.
    """
    _positive("d", d)
    _positive("heads", heads)
    if d % heads:
        raise ValueError(f"d ({d}) must be divisible by heads ({heads})")
    n_proj = 4 if out_proj else 3
    return heads * 3 * d * (d // heads) + (d * d if out_proj else 0) + (n_proj * d if bias else 0)


def attention_cost(n: int, d: int, heads: int = 1, *, layers: int = 1, batch: int = 1,
                   dtype: str = "float32", backend: str = "reference", causal: bool = False,
                   bias: bool = False, block: int = 128) -> AttentionCost:
    """Cost of ``layers`` self-attention layers (with Q/K/V/O projections) on a batch.

    Args:
        n: sequence length.
        d: model width (``embed_dim``); ``d / heads`` is the head width.
        heads: number of heads.
        layers: number of layers; memory figures are per layer (layers run one after another).
        batch: batch size.
        dtype: one of ``float64``, ``float32``, ``float16``, ``bfloat16``.
        backend: a materialising backend (``reference``, ``naive``, ``math``) or a tiled one
            (``sdpa``, ``flash``, ``blockwise``, modelled with ``block`` x ``block`` tiles).
        causal: a causal mask; halves the attention FLOPs (the projections are unchanged).
        bias: count projection biases in the parameters.
        block: tile size of tiled backends.

    Returns:
        An :class:`AttentionCost`.

    Raises:
        ValueError: a non-positive size, ``d`` not divisible by ``heads``, or an unknown dtype or
            backend.
    """
    for name, value in (("n", n), ("layers", layers), ("batch", batch), ("block", block)):
        _positive(name, value)
    params = projection_params(d, heads, bias=bias) * layers
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if backend not in MATERIALISING + TILED:
        raise ValueError(f"backend must be one of {list(MATERIALISING + TILED)}, got {backend!r}")
    size = DTYPE_BYTES[dtype]
    density = 0.5 if causal else 1.0
    proj = 4 * 2.0 * batch * n * d * d * layers
    attn = 2 * 2.0 * batch * n * n * d * density * layers
    elements = batch * heads * n * n
    if backend in MATERIALISING:
        # The reference returns the weights, so scores and weights are both alive at the softmax.
        peak = elements * size * (2 if backend == "reference" else 1)
    else:
        tile = min(block, n)
        peak = batch * heads * (tile * tile * size + 2 * n * 4)  # one tile + float32 row max and sum
    return AttentionCost(n=n, d=d, heads=heads, layers=layers, batch=batch, dtype=dtype, backend=backend,
                         causal=causal, bias=bias, projection_flops=proj, attention_flops=attn,
                         score_elements=elements, score_bytes=elements * size, peak_attention_bytes=peak,
                         params=params)


def compare_heads(d: int, heads: int, *, n: int | None = None, bias: bool = False) -> list[str]:
    """Single-head versus multi-head attention of width ``d``, as multi-head tutorials compare them.

    Returns:
        Readable lines: per-head and total parameter counts, why they are equal, and (with ``n``)
        what does change: the number of score matrices.
    """
    h, hd = heads, d // heads
    single_qkv = projection_params(d, 1, out_proj=False, bias=bias)
    per_head = 3 * d * hd + (3 * hd if bias else 0)
    multi_total = projection_params(d, h, bias=bias)
    out = d * d + (d if bias else 0)
    b = " with biases" if bias else ", no biases"
    lines = [
        f"single head{b}: Q, K, V are {d} x {d}: 3 x {d} x {d} = {single_qkv:,}",
        f"  + output projection {d} x {d} = {out:,} -> {single_qkv + out:,}",
        f"{h} heads{b}: each head's Q, K, V are {d} x {hd}: 3 x {d} x {hd} = {per_head:,} per head",
        f"  {h} x {per_head:,} + output projection {d} x {d} = {h * per_head:,} + {out:,} = {multi_total:,}",
        f"equal: {h} heads of width {hd} slice the same 3 x {d} x {d} projection weights",
        f"  that one head of width {d} uses; splitting adds no parameters",
    ]
    if n is not None:
        lines.append(f"what does change: {h} score matrices of {n} x {n} instead of one "
                     f"({h * n * n:,} elements, not {n * n:,}); the FLOPs are the same")
    if not bias and (d, h) == (512, 8):
        seed_total = 1_032_192
        lines += [
            f"note: a widely copied multi-head parameter count says {seed_total:,} for 8 x 98,304 + 512 x 512,",
            f"  which is {multi_total:,}: that sum is {multi_total - seed_total:,} short (an addition slip); it also "
            "counts the single head",
            "  without its output projection, hence its claim that more heads mean more parameters",
        ]
    return lines
