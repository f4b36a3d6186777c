"""Adapters that let attnkit run inside libraries people already use (Hugging Face transformers).

Each adapter is a module named for its library (``attnkit.integrations.transformers``), imported
by name; the package offers no names of its own, so importing it imports none of those libraries.
"""

__all__ = []
