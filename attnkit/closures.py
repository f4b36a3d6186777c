"""Find the tensors a ``score_mod`` closes over, so gradients can flow into them.

A score_mod such as ``alibi(slopes)`` or ``relative_position_bias(table)`` captures tensors that may
be ``nn.Parameter``s. The tiles backend recomputes the score_mod tile by tile in its backward
pass and asks autograd for the gradient of each captured tensor; to do that it must know them. They
are found by walking the function's closure cells, default arguments, the module globals it names,
``functools.partial`` arguments, bound ``nn.Module``s (parameters, buffers, tensor attributes) and
callable objects; the mask plan's cache keys on what the same walk finds (:func:`captured_state`).
:func:`check_covered` then proves, on a one-cell probe, that no other tensor requiring grad feeds
the score_mod, so a gradient can never be dropped silently.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

_MAX_DEPTH = 8

#: What every ``nn.Module`` keeps in its ``__dict__`` for itself (hooks; the parameter, buffer and
#: submodule dicts, walked through ``parameters()``, ``buffers()`` and ``modules()``): not the user's
#: state. ``training`` is left in: a predicate may read it.
_MODULE_OWN = frozenset(vars(torch.nn.Module())) - {"training"}

#: Plain values a predicate may read and a caller may change between calls (a window's width, a mode).
_SCALARS = (bool, int, float, str, type(None))


def captured_tensors(fn, *, requiring_grad: bool = True) -> list[Tensor]:
    """Tensors that ``fn`` can reach (only those that require grad, unless ``requiring_grad`` is
    False), in a fixed order, without duplicates: see :func:`captured_state`."""
    if requiring_grad:
        return [t for t in captured_state(fn)[0] if t.requires_grad]
    return captured_state(fn)[0]


def captured_state(fn) -> tuple[list[Tensor], list]:
    """What ``fn`` can reach: its tensors (in a fixed order, without duplicates) and its plain values
    (``bool``, ``int``, ``float``, ``str``, None: in the order met, repeats included).

    Walked: closure cells, default arguments, the globals its code names (tensors, modules, plain
    values and functions of its own module), ``functools.partial`` arguments, lists, tuples, sets
    and dict values, a bound method's object, the attributes of callable objects, and of an
    ``nn.Module`` (and each of its submodules) its parameters, buffers and every attribute it was
    given (plain tensors included), up to a depth of 8.

    Not seen: objects that are neither callable nor modules (a config object's fields), numpy
    arrays, and what a tensor holds beyond its identity and version counter (an edit through
    ``.data`` or through numpy memory leaves the counter as it was).
    """
    found: list[Tensor] = []
    values: list = []
    seen: set[int] = set()

    def visit(obj, depth: int) -> None:
        if isinstance(obj, _SCALARS):
            values.append(obj)  # before `seen`: a value met twice counts twice, so positions stay put
            return
        if depth > _MAX_DEPTH or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            found.append(obj)
        elif isinstance(obj, torch.nn.Module):
            for sub in obj.modules():  # one walk of the tree (parameters(), buffers() would walk it again)
                for t in sub._parameters.values():
                    visit(t, depth + 1)
                for t in sub._buffers.values():
                    visit(t, depth + 1)
                for name, value in vars(sub).items():
                    if name not in _MODULE_OWN:
                        visit(value, depth + 1)
        elif isinstance(obj, list | tuple | set | frozenset):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(obj.keywords, depth + 1)
        elif inspect.ismethod(obj):
            visit(obj.__self__, depth + 1)
            visit(obj.__func__, depth + 1)
        elif inspect.isfunction(obj):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
            visit(obj.__defaults__, depth + 1)
            visit(obj.__kwdefaults__, depth + 1)
            for name in obj.__code__.co_names:
                g = obj.__globals__.get(name)
                if isinstance(g, (Tensor, torch.nn.Module, *_SCALARS)) and g is not None or (
                        inspect.isfunction(g) and g.__module__ == obj.__module__):
                    visit(g, depth + 1)
        elif callable(obj) and hasattr(obj, "__dict__") and not inspect.ismodule(obj) \
                and not inspect.isclass(obj):
            visit(vars(obj), depth + 1)

    visit(fn, 0)
    return found, values


def check_covered(score_mod, captured: list[Tensor], dtype: torch.dtype, device) -> None:
    """Raise ``ValueError`` if a tensor requiring grad feeds ``score_mod`` but is not in ``captured``.

    ``score_mod`` is run on one cell with all indices 0; autograd's graph of the result is walked
    back, stopping at the score itself and at the captured tensors.
    """
    x = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device, requires_grad=True)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.int64, device=device)
    with torch.enable_grad():
        y = score_mod(x, zero, zero, zero, zero)
    if not isinstance(y, Tensor) or y.grad_fn is None:
        return
    stops = {id(t.grad_fn) for t in captured if t.grad_fn is not None}
    leaves = {id(t) for t in captured if t.grad_fn is None} | {id(x)}
    todo, visited = [y.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in visited or id(node) in stops:
            continue
        visited.add(id(node))
        var = getattr(node, "variable", None)
        if var is not None and id(var) not in leaves:
            raise ValueError(
                f"score_mod uses a tensor of shape {tuple(var.shape)} that requires grad but could not be "
                "found in its closure, defaults or globals; capture it in a closure (as attnkit.scores "
                "does) or use backend='reference'")
        todo.extend(n for n, _ in node.next_functions)
