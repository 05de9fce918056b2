"""research.data: ListOps generation, CIFAR-10 and IMDB loading (from tiny fixtures)."""
import os

import numpy as np
import pytest
import torch

from research.data import LISTOPS_VOCAB, ListOps, evaluate_listops, generate_listops, load_cifar10, load_imdb
from research.data.listops import tokens_to_string

from data_fixtures import IMDB_TEXTS, write_fake_cifar, write_fake_imdb


def encode(expr):
    return [LISTOPS_VOCAB[t] for t in expr.split()]


# ------------------------------------------------------------------ ListOps

@pytest.mark.parametrize("expr,value", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[MIN 5 [MAX 1 3 ] 4 ]", 3),
    ("[MED 1 5 3 9 ]", 4),           # even count: floor of the mean of the middle two
    ("[MED 7 2 9 ]", 7),
    ("[MED 0 1 ]", 0),
    ("[SM 5 6 7 ]", 8),               # 18 mod 10
    ("[SM [MAX 9 9 ] [SM 9 9 ] 3 ]", 0),  # 9 + 8 + 3 = 20
    ("[MAX [MED [SM 4 4 ] 1 2 3 ] [MIN 6 9 ] ]", 6),
])
def test_evaluate_hand_written(expr, value):
    assert evaluate_listops(encode(expr)) == value
    assert evaluate_listops(encode(expr) + [0, 0, 0]) == value  # padding ignored
    assert tokens_to_string(encode(expr) + [0]) == expr


def test_evaluate_rejects_bad_expressions():
    for bad in ("[MAX 1 2", "1 ]", "[MAX 1 2 ] ]"):
        with pytest.raises(ValueError):
            evaluate_listops(encode(bad))
    with pytest.raises(ValueError):
        evaluate_listops([99])


def test_generate_shapes_lengths_and_labels():
    x, y = generate_listops(300, 128, seed=3)
    assert x.shape == (300, 128) and x.dtype == torch.int64
    assert y.shape == (300,) and y.dtype == torch.int64
    lengths = (x != 0).sum(1)
    assert int(lengths.min()) >= 32 and int(lengths.max()) <= 128
    for i in range(300):
        n = int(lengths[i])
        assert (x[i, n:] == 0).all() and (x[i, :n] != 0).all()  # right padding only
        assert int(x[i, 0]) in (11, 12, 13, 14)  # the root is an operator
        assert evaluate_listops(x[i]) == int(y[i])  # labels agree with an independent parser
    counts = torch.bincount(y, minlength=10)
    assert int(counts.min()) >= 10  # all ten classes occur, none dominates
    assert int(counts.max()) <= 80


def test_generate_is_deterministic():
    a = generate_listops(50, 64, seed=7)
    b = generate_listops(50, 64, seed=7)
    c = generate_listops(50, 64, seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_generate_long_sequences_and_options():
    x, y = generate_listops(20, 512, seed=0)
    lengths = (x != 0).sum(1)
    assert int(lengths.min()) >= 128 and int(lengths.max()) <= 512
    x, _ = generate_listops(20, 40, min_len=5, max_depth=2, max_args=3, seed=1)
    # depth <= 2 means at most two open brackets at any point
    for row in x:
        depth = 0
        for t in row.tolist():
            depth += t in (11, 12, 13, 14)
            depth -= t == 15
            assert depth <= 2
    with pytest.raises(ValueError, match="max_len"):
        generate_listops(1, 2)
    with pytest.raises(ValueError, match="min_len"):
        generate_listops(1, 10, min_len=11)


def test_listops_dataset():
    ds = ListOps(10, 64, seed=1)
    assert len(ds) == 10 and ds.vocab_size == 16 and ds.num_classes == 10
    tok, lab = ds[3]
    assert tok.shape == (64,) and evaluate_listops(tok) == int(lab)


# ------------------------------------------------------------------ CIFAR-10

def gray(data_row):
    r, g, b = (data_row[c * 1024:(c + 1) * 1024].astype(np.float64) for c in range(3))
    return np.round(0.299 * r + 0.587 * g + 0.114 * b).astype(np.int64) + 1


def test_cifar_train_and_test(tmp_path):
    written = write_fake_cifar(str(tmp_path))
    x, y = load_cifar10(str(tmp_path), "train")
    assert x.shape == (15, 1024) and y.shape == (15,)
    want_labels = sum((written[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert y.tolist() == want_labels
    # image 4 is batch 2's second image
    np.testing.assert_array_equal(x[4].numpy(), gray(written["data_batch_2"][0][1]))
    assert int(x.min()) >= 1 and int(x.max()) <= 256
    xt, yt = load_cifar10(str(tmp_path / "cifar-10-batches-py"), "test")  # the folder itself works too
    assert xt.shape == (2, 1024) and yt.tolist() == written["test_batch"][1]


def test_cifar_rgb_and_limit(tmp_path):
    written = write_fake_cifar(str(tmp_path))
    x, y = load_cifar10(str(tmp_path), "train", grayscale=False, limit=4)
    assert x.shape == (4, 3072) and len(y) == 4
    d = written["data_batch_1"][0][0].astype(np.int64)
    # pixel p's channels are adjacent: (R, G, B) of pixel 5 at 15, 16, 17
    assert x[0, 15:18].tolist() == [d[5] + 1, d[1024 + 5] + 1, d[2048 + 5] + 1]


def test_cifar_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        load_cifar10(str(tmp_path / "nowhere"))
    write_fake_cifar(str(tmp_path))
    os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_3")
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_cifar10(str(tmp_path), "train")
    with pytest.raises(ValueError, match="split"):
        load_cifar10(str(tmp_path), "valid")


# ------------------------------------------------------------------ IMDB

def test_imdb_bytes_labels_order(tmp_path):
    write_fake_imdb(str(tmp_path))
    x, y = load_imdb(str(tmp_path), "train", max_len=16)
    assert x.shape == (5, 16) and y.tolist() == [0, 0, 1, 1, 1]
    # negatives first, in sorted file order
    want = list(b"Dull.")
    assert x[0, :5].tolist() == [b + 1 for b in want] and (x[0, 5:] == 0).all()
    # UTF-8: the em dash is three bytes; truncation at max_len
    text = IMDB_TEXTS[("train", "pos")][1].encode("utf-8")[:16]
    assert x[3].tolist() == [b + 1 for b in text]
    xt, yt = load_imdb(str(tmp_path / "aclImdb"), "test", max_len=64)
    assert xt.shape == (2, 64) and yt.tolist() == [0, 1]


def test_imdb_limit_and_missing(tmp_path):
    write_fake_imdb(str(tmp_path))
    x, y = load_imdb(str(tmp_path), "train", max_len=8, limit=1)
    assert y.tolist() == [0, 1]
    with pytest.raises(FileNotFoundError, match="aclImdb"):
        load_imdb(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="split"):
        load_imdb(str(tmp_path), "dev")


def test_listops_shortest_expression_is_four_tokens():
    with pytest.raises(ValueError, match=">= 4"):
        generate_listops(5000, 3)  # used to draw 5 million trees (~30 s) before failing
    x, y = generate_listops(20, 4, seed=0)
    assert ((x != 0).sum(1) == 4).all()
    for row, label in zip(x, y):
        assert evaluate_listops(row) == label


def _write_batches(root, content):
    """Every batch file of root/cifar-10-batches-py: ``content`` pickled, or as is if bytes; returns data_batch_1's path."""
    import pickle
    d = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(d, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(os.path.join(d, name), "wb") as f:
            f.write(content if isinstance(content, bytes) else pickle.dumps(content))
    return os.path.join(d, "data_batch_1")


_DATA = np.random.default_rng(0).integers(0, 256, (20, 3072), dtype=np.uint8)


@pytest.mark.parametrize("content,needle", [
    ({b"data": _DATA, b"labels": [1] * 7}, "(7,) labels for 20 images"),  # used to pair labels with other images
    ({b"data": _DATA, b"labels": [11] * 10 + [-1] * 10}, "0..9"),
    ({b"data": _DATA[:, :1000], b"labels": [0] * 20}, "(N, 3072)"),
    ({b"data": _DATA}, "'labels'"),
    ([_DATA], "expected a dict"),
    (b"not a pickle at all", "not a readable pickle"),
], ids=["short_labels", "label_range", "shape", "no_labels", "not_a_dict", "garbage"])
def test_cifar_bad_batches_name_the_file(tmp_path, content, needle):
    path = _write_batches(str(tmp_path), content)
    with pytest.raises(ValueError, match="CIFAR-10 batch") as e:
        load_cifar10(str(tmp_path), "train", limit=10)
    assert path in str(e.value) and needle in str(e.value)


def test_cifar_str_keys_read_like_bytes_keys(tmp_path):
    written = write_fake_cifar(str(tmp_path / "a"))
    d = tmp_path / "b" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    import pickle
    for name, (data, labels) in written.items():
        with open(d / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels}, f)
    for split in ("train", "test"):
        xa, ya = load_cifar10(str(tmp_path / "a"), split)
        xb, yb = load_cifar10(str(tmp_path / "b"), split)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
