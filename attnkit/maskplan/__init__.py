"""The mask plan: which keys each query row may attend, worked out once and read by every kernel.

The subsystem that turns a mask into each row's intervals of keys, in the order a call meets it:

* :mod:`.plan` - the :class:`MaskPlan` type and :func:`mask_plan`, its public builder;
* :mod:`.plan_cache` - :func:`for_call`, the plan of a validated call, kept per predicate across calls
  (``attnkit.maskplan.plan_cache.PLANS_PER_PREDICATE = 0`` turns it off);
* :mod:`.derivation` - :func:`row_intervals`, the one entry that works a predicate's rows out, by the first
  of the ways below that can follow it (``MaskPlan.derived_by`` names it): :mod:`.closed_form`
  (:func:`.closed_form.interval_tables`), :mod:`.ranges` (:func:`.ranges.flat_runs`), :mod:`.every_cell`;
* :mod:`.stand_ins` - the index stand-ins those ways call a predicate with, the derivation's state
  and :class:`CannotFollow`, the one signal the order catches;
* :mod:`.rows` - runs of allowed keys packed into ``[P, Lq, K]`` tables;
* :mod:`.tile_kinds` - empty / full / partial (query tile, key block) pairs from intervals.

The interval algebra itself, and :func:`attnkit.intervals.row_bounds` for ``is_causal``/``window``,
sit one layer down in :mod:`attnkit.intervals`, shared with the typed masks of
:mod:`attnkit.masks`. Public names: ``attnkit.mask_plan`` and ``attnkit.MaskPlan``.

Older names that keep working: ``derive`` is :func:`row_intervals`; ``attnkit.maskplan.cache`` is
:mod:`.plan_cache` (the same module: setting ``PLANS_PER_PREDICATE`` through either name sets it).
"""

import sys as _sys

from . import plan_cache
from .derivation import row_intervals
from .plan import MaskPlan, check_intervals, mask_plan
from .plan_cache import for_call
from .rows import MAX_INTERVALS
from .stand_ins import CannotFollow

derive = row_intervals
_sys.modules[f"{__name__}.cache"] = plan_cache

__all__ = ["MAX_INTERVALS", "CannotFollow", "MaskPlan", "check_intervals", "derive", "for_call", "mask_plan",
           "row_intervals"]
