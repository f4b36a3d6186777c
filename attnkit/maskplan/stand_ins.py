"""Stand-ins for a predicate's index tensors, and the one signal a derivation may catch.

The closed form (:mod:`.closed_form`) and the ranges evaluation (:mod:`.ranges`) work a predicate
out by calling it once with stand-ins in place of ``b``, ``h``, ``q_idx`` and ``kv_idx``: objects
whose torch functions, tensor methods and Python operators go through a table of rules
(:func:`stands_in`, :func:`rule_table`). Whatever a rule cannot follow raises
:class:`CannotFollow`; that, and its kind :class:`ReadsHead`, is the only exception the derivation
order (:mod:`.derivation`) catches: any other is a bug and surfaces.

A derivation's working state (what failed, tables built for it, the closed form's blocks of rows)
is one :class:`Derivation` object, made by the strategy that runs (:func:`deriving`). Torch calls
the rules with only the predicate's own arguments, so the rules reach the derivation under way
through :func:`current`, a context variable: each thread (and each asyncio task) sees its own.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
from torch import Tensor


class CannotFollow(Exception):
    """The stand-ins cannot follow what the predicate does: the next way of deriving its rows takes over.

    Noted on the derivation under way as it is made, so that it counts even if the predicate
    catches it and goes on (a predicate that caught it would be followed along a path the real
    indices never take)."""

    def __init__(self, what: str):
        super().__init__(what)
        d = _current.get()
        if d is not None:
            d.failed.append(what)


class ReadsHead(CannotFollow):
    """The predicate reads the head index: its rows are worked out per head (heads folded into the batch)."""

    def __init__(self):
        super().__init__("the predicate reads the head")


@dataclass
class Derivation:
    """The working state of one derivation of a predicate's rows.

    ``failed``: what the stand-ins could not follow, in order. ``tables``: range tables of the
    tensors the predicate indexes (:mod:`.ranges`), by ``id``, with the tensor itself to check
    the id. The rest is the closed form's (:mod:`.closed_form`): ``kv_len``; in block mode the
    first rows of the blocks and their spans (``[R, 1]``; None: each row on its own); ``flips``,
    the rows where a choice came out differently at a block's two ends; and ``not_blocks``, set
    when something cannot be followed across a block.
    """

    kv_len: int = 0
    failed: list[str] = field(default_factory=list)
    tables: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)
    first: Tensor | None = None
    span: Tensor | None = None
    flips: list[Tensor] = field(default_factory=list)
    not_blocks: bool = False


_current: contextvars.ContextVar[Derivation | None] = contextvars.ContextVar("attnkit_derivation", default=None)


@contextlib.contextmanager
def deriving(**fields):
    """Make a fresh :class:`Derivation` (with ``fields``) the current one for the body, and drop it after."""
    d = Derivation(**fields)
    token = _current.set(d)
    try:
        yield d
    finally:
        _current.reset(token)


def current() -> Derivation:
    """The derivation under way (a rule runs only inside one)."""
    d = _current.get()
    if d is None:
        raise RuntimeError("a stand-in rule ran outside a derivation (attnkit.maskplan.stand_ins.deriving)")
    return d


def apply(rules: dict, name: str, *args, **kwargs):
    """The rule for operation ``name``; any failure inside it is an :class:`CannotFollow`, noted
    for the derivation even if the predicate catches it."""
    rule = rules.get(name)
    if rule is None:
        raise CannotFollow(f"{name} on index stand-ins")
    try:
        return rule(*args, **kwargs)
    except CannotFollow:
        raise
    except Exception as e:  # noqa: BLE001 (a rule's own TypeError, a shape mismatch: all the same to the caller)
        raise CannotFollow(f"{name}: {e}") from e


def stands_in(cls: type, rules: dict) -> type:
    """Make ``cls`` stand in for index tensors: torch functions, tensor methods and Python operators
    on it go through ``rules`` (name -> rule), and everything else, Python control flow on it
    included, raises :class:`CannotFollow` (not Python's TypeError: a predicate that caught that and
    went another way would be followed along a path the real indices never take)."""

    def torch_function(klass, func, types, args=(), kwargs=None):
        return apply(rules, getattr(func, "__name__", ""), *args, **(kwargs or {}))

    def as_number(self):
        raise CannotFollow("an index used as a Python number")

    def control_flow(self):
        raise CannotFollow("Python control flow on an index")

    def attribute(self, name):  # tensor methods (q_idx.abs(), .long(), .new_ones(...)) as torch functions
        if name.startswith("__"):
            raise AttributeError(name)  # protocol probes (hasattr) see a plain object
        if name not in rules:
            raise CannotFollow(f"attribute {name} of an index stand-in")
        return lambda *args, **kwargs: apply(rules, name, self, *args, **kwargs)

    # No __index__, __len__, __iter__ or __getitem__: torch's indexing probes for them (is this an
    # integer, a sequence?) and, finding none, goes on to __torch_function__.
    cls.__torch_function__ = classmethod(torch_function)
    cls.__bool__, cls.__int__, cls.__float__, cls.__getattr__ = control_flow, as_number, as_number, attribute
    for name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__neg__", "__abs__",
                 "__truediv__", "__floordiv__", "__mod__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
                 "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__invert__"):
        setattr(cls, name, (lambda n: lambda self, *args: apply(rules, n, self, *args))(name))
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "xor"):  # x += 1: a new value
        setattr(cls, f"__i{name}__", getattr(cls, f"__{name}__"))
    cls.__hash__ = None  # __eq__ returns a stand-in

    def refuse(name: str):
        def refused(self, *args):
            raise CannotFollow(f"{name} on an index stand-in")
        return refused

    for name in ("__pow__", "__rpow__", "__rtruediv__", "__rfloordiv__", "__rmod__", "__divmod__", "__rdivmod__",
                 "__matmul__", "__rmatmul__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__pos__",
                 "__round__", "__trunc__", "__floor__", "__ceil__", "__setitem__", "__contains__",
                 "__call__", "__ipow__", "__imatmul__", "__ilshift__", "__irshift__", "__complex__", "__reversed__"):
        if name not in vars(cls):
            setattr(cls, name, refuse(name))
    return cls


#: Each operation the stand-ins follow, under the names torch calls it by (functions, methods, operators).
NAMES = {
    "add": ("add", "__add__", "__iadd__"), "sub": ("sub", "subtract", "__sub__", "__isub__"),
    "mul": ("mul", "multiply", "__mul__", "__imul__", "__rmul__"), "neg": ("neg", "negative", "__neg__"),
    "abs": ("abs", "absolute", "__abs__"), "div": ("div", "divide", "true_divide", "__truediv__"),
    "floor_divide": ("floor_divide", "__floordiv__"), "remainder": ("remainder", "__mod__"),
    "minimum": ("minimum",), "maximum": ("maximum",), "clamp": ("clamp", "clip"),
    "lt": ("lt", "less", "__lt__"), "le": ("le", "less_equal", "__le__"), "gt": ("gt", "greater", "__gt__"),
    "ge": ("ge", "greater_equal", "__ge__"), "eq": ("eq", "__eq__"), "ne": ("ne", "not_equal", "__ne__"),
    "and": ("logical_and", "bitwise_and", "__and__", "__rand__", "__iand__"),
    "or": ("logical_or", "bitwise_or", "__or__", "__ror__", "__ior__"),
    "xor": ("logical_xor", "bitwise_xor", "__xor__", "__rxor__"),
    "not": ("logical_not", "bitwise_not", "__invert__"), "where": ("where",), "getitem": ("__getitem__",),
}


def rule_table(ops: dict, cast, constant) -> dict:
    """Name -> rule for a stand-in: each operation of ``ops`` under all its :data:`NAMES`, the
    reflected ``+`` and ``-``, casts (``.to(dtype)``, ``.long()``, ...) through ``cast(a, dtype)``
    (dtype None: ``a`` as it is), and constants shaped like an index (``ones_like``,
    ``new_full``, ...) through ``constant(a, value, dtype)``."""
    table = {name: rule for op, rule in ops.items() for name in NAMES[op]}
    table["__radd__"] = lambda a, b, **kw: ops["add"](b, a, **kw)
    table["__rsub__"] = table["rsub"] = lambda a, b, *rest, **kw: ops["sub"](b, a, *rest, **kw)

    def to(a, *args, dtype=None, **kwargs):
        for x in args:
            if isinstance(x, torch.dtype):
                dtype = x
            elif not isinstance(x, (torch.device, str)):
                raise CannotFollow("to() with a tensor")
        return cast(a, dtype)

    table["to"] = to
    for name, dtype in (("long", torch.int64), ("int", torch.int32), ("bool", torch.bool),
                        ("float", torch.float32), ("double", torch.float64)):
        table[name] = (lambda d: lambda a, *_, **__: cast(a, d))(dtype)
    for names, value in ((("ones_like", "new_ones"), 1), (("zeros_like", "new_zeros"), 0)):
        for name in names:
            table[name] = (lambda v: lambda a, *_, dtype=None, **__: constant(a, v, dtype))(value)
    table["full_like"] = lambda a, fill, *, dtype=None, **_: constant(a, fill, dtype)
    table["new_full"] = lambda a, size, fill, *, dtype=None, **_: constant(a, fill, dtype)
    return table


def call_on_stand_ins(mod, *stand_ins):
    """``mod(*stand_ins)``, where an exception the predicate itself raises (its own check on what it
    was given, a ``TypeError`` from Python code the stand-ins do not model) becomes
    :class:`CannotFollow`: the next way of deriving calls it on real indices, where it raises again
    if it is a real error. Exceptions from attnkit's own code after this call are not caught."""
    try:
        return mod(*stand_ins)
    except CannotFollow:
        raise
    except Exception as e:  # noqa: BLE001 - the predicate's own code, on stand-ins: not followed
        raise CannotFollow(f"the predicate raised {type(e).__name__} on stand-ins: {e}") from e
