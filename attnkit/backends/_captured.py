"""Find the tensors a ``score_mod`` closes over, so gradients can flow into them.

A score_mod such as ``alibi(slopes)`` or ``relative_position_bias(table)`` captures tensors that may
be ``nn.Parameter``s. The tiles backend recomputes the score_mod tile by tile in its backward
pass and asks autograd for the gradient of each captured tensor; to do that it must know them. They
are found by walking the function's closure cells, default arguments, the module globals it names,
``functools.partial`` arguments, bound ``nn.Module``s and callable objects. :func:`check_covered`
then proves, on a one-cell probe, that no other tensor requiring grad feeds the score_mod, so a
gradient can never be dropped silently.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

_MAX_DEPTH = 8


def captured_tensors(fn, *, requiring_grad: bool = True) -> list[Tensor]:
    """Tensors that ``fn`` can reach (only those that require grad, unless ``requiring_grad`` is
    False), in a fixed order, without duplicates."""
    found: list[Tensor] = []
    seen: set[int] = set()

    def visit(obj, depth: int) -> None:
        if depth > _MAX_DEPTH or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.requires_grad or not requiring_grad:
                found.append(obj)
        elif isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                visit(p, depth + 1)
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
                if isinstance(g, Tensor | torch.nn.Module) or (
                        inspect.isfunction(g) and g.__module__ == obj.__module__):
                    visit(g, depth + 1)
        elif callable(obj) and hasattr(obj, "__dict__") and not inspect.ismodule(obj) \
                and not inspect.isclass(obj):
            visit(vars(obj), depth + 1)

    visit(fn, 0)
    return found


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
