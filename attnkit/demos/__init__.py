"""Runnable demonstrations behind ``attnkit demo``."""
