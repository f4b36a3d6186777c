"""Transitional: the old ``BlockwiseBackend(fused=, band=)`` flags mapped onto the named backends
``"band"``, ``"fused_tiles"`` and ``"tiles"``. Not registered; removed once nothing imports it."""

from __future__ import annotations

from torch import Tensor

from ..request import Request
from .band import BandBackend
from .tiles import TilesBackend, _fused_serves


class BlockwiseBackend:
    name = "blockwise"

    def __init__(self, *, q_tile=None, kv_block=None, kv_chunk=None, score_budget=None, fused=None, band=None):
        for arg, val in (("fused", fused), ("band", band)):
            if val is not None and not isinstance(val, bool):
                raise TypeError(f"{arg} must be True, False or None, got {val!r}")
        if band and fused is False:
            raise ValueError("band=True contradicts fused=False (the plain path everywhere)")
        self.tiles = dict(q_tile=q_tile, kv_block=kv_block, kv_chunk=kv_chunk, score_budget=score_budget)
        TilesBackend(fused=False, **self.tiles)  # argument checks
        self.fused, self.band = fused, band

    def _pick(self, req: Request):
        given = any(v is not None for v in self.tiles.values())
        if self.band is not False and self.fused is not False and (self.band or not given):
            if not BandBackend().not_supported_reasons(req) or self.band:
                return BandBackend()
        return TilesBackend(fused=self.fused is not False and _fused_serves(req), **self.tiles)

    def not_supported_reasons(self, req: Request) -> list[str]:
        if self.fused and not _fused_serves(req):
            return ["fused=True needs no score_mod, a CPU tensor, values as wide as queries"]
        return self._pick(req).not_supported_reasons(req)

    def __call__(self, req: Request) -> tuple[Tensor, None]:
        return self._pick(req)(req)
