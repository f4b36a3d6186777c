"""Self-attention applied: small models that train from scratch on 2 CPU cores in minutes.

Each task is a module ``attnkit.apps.<task>`` that reads top to bottom (data -> model -> train ->
evaluate -> pictures), is built from :mod:`attnkit.modules`, and exposes ``DEFAULTS``, ``QUICK``,
``run(out=..., steps=None, seed=0, quick=False, progress=True) -> Result`` and ``load(dir)``:

* ``vit``: a Vision Transformer on scikit-learn's 8x8 handwritten digits, beside a CNN of about the
  same size, both at 10%, 30% and 100% of the training data; attention rollout over the digit.
* ``caption``: strips of 3 to 5 digits -> the caption "4 7 1"; cross-attention over the strip.
* ``translate``: a sequence-to-sequence Transformer translating numbers written in French into German
  (num2words' grammars), or English dates in words into ISO dates; greedy and beam decoding with the
  KV cache; a Bahdanau RNN with additive attention beside it; the alignment matrix.
* ``classify``: text classification with attention pooling against a bag-of-words baseline.
* ``recommend``: next-item prediction over sessions with causal self-attention (SASRec-style).
* ``lm``: a character-level GPT on the Python standard library's own docstrings, against smoothed
  bigram and trigram baselines; samples through the KV cache; previous-token and induction heads.
* ``recall``: recall of a cued token across a distance, ``nn.RNN`` and ``nn.LSTM`` against
  attention of the same size; accuracy against distance, time per step against length.
* ``graph``: graph attention (GAT) with the adjacency as the mask, on Zachary's karate club (networkx),
  against neighbour averaging and an MLP that ignores the edges, over several seeds.
* ``forecast``: a causal Transformer forecasting monthly CO2 at Mauna Loa (statsmodels' data file)
  beside an LSTM and the seasonal-naive forecast; the attention per lag.
* ``tag``: a label for every token of the standard library's source (tokenize and ast roles),
  against the majority tag and each token's own commonest tag.

``attnkit train TASK`` runs one and writes its checkpoint, pictures and an HTML report. Tasks are
imported on first use (:func:`task`), so importing this package imports no torch.
"""

from .tasks import TASKS, task

__all__ = ["TASKS", "task"]
