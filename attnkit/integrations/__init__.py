"""Adapters that let attnkit run inside libraries people already use (Hugging Face transformers)."""
