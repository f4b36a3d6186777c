"""Runnable demonstrations behind ``attnkit demo``.

Its modules are what the command runs (``synthetic``, ``real_model``); the package itself offers
no names, so that importing it imports neither torch nor a model.
"""

__all__ = []
