"""Tiny stand-ins for the CIFAR-10 and IMDB folders, written into a test's tmp_path."""
import os
import pickle

import numpy as np


def write_fake_cifar(root, per_batch=3, n_test=2, seed=0):
    """root/cifar-10-batches-py/{data_batch_1..5, test_batch} in the real format.
    Returns {name: (data (N, 3072) uint8, labels list)}."""
    rng = np.random.default_rng(seed)
    d = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(d, exist_ok=True)
    written = {}
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", n_test)]:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, size=n)]
        with open(os.path.join(d, name), "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [b"x.png"] * n}, f)
        written[name] = (data, labels)
    return written


IMDB_TEXTS = {
    ("train", "pos"): ["A great film!", "Loved it \u2014 really.", "Superb acting and a fine score."],
    ("train", "neg"): ["Dull.", "Two hours I will not get back."],
    ("test", "pos"): ["Wonderful."],
    ("test", "neg"): ["Awful, awful, awful."],
}


def write_fake_imdb(root):
    """root/aclImdb/{train,test}/{pos,neg}/<i>_<rating>.txt with IMDB_TEXTS."""
    for (split, label), texts in IMDB_TEXTS.items():
        d = os.path.join(root, "aclImdb", split, label)
        os.makedirs(d, exist_ok=True)
        for i, t in enumerate(texts):
            with open(os.path.join(d, f"{i}_{8 if label == 'pos' else 2}.txt"), "w", encoding="utf-8") as f:
                f.write(t)
    return os.path.join(root, "aclImdb")
