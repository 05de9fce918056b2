"""The paper's experiments at a size a laptop runs.

    python -m research.train --task listops --attention hkt --seed 0 --out run.json
    python -m research.reproduce --task listops --seeds 0 1 2 --out results/listops.json
    python -m research.listops_compare  # a 2-3 minute HKT vs standard ListOps run
    python -m research.bytelm train   # byte-level LM on the stdlib's sources; then `... bytelm generate`
    python -m research.lm_run         # resumable LM comparison, HKT levels 1, 2, 3 at T=1024
    python -m research.trained_analysis --checkpoint CKPT --out DIR   # what a trained model learned

Extras: ``pip install "hkt[experiments]"`` adds tqdm (progress bars; without it
training runs without them) and matplotlib (the plot of ``research.theory``).

One small Transformer classifier (token + position embeddings,
``nn.TransformerEncoder``, mean pooling, a linear head) is trained with standard
attention or, after :func:`hkt.swap_attention`, with HKT; nothing else differs
(same initialisation, data order and optimiser for a given seed).

``from research import train_classifier, build_model, ...`` works; the
submodule is imported on first use, so that ``python -m research.train``
runs its module exactly once.
"""
import importlib

__all__ = ["TASKS", "Classifier", "build_model", "load_task", "evaluate", "train_classifier"]


def __getattr__(name):
    if name in __all__:
        return getattr(importlib.import_module(".train", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
