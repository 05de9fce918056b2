"""research.extend: the context-extension experiment's arms keep the base's weights; --smoke writes its records."""
import json

import pytest
import torch

from research import extend, longrange
from helpers import one_thread  # noqa: F401  (autouse fixture: one torch thread)

SMALL = dict(extend.DEFAULTS, base_len=32, d_model=16, layers=1, heads=2, ft_len=128, lengths=[128])


@pytest.mark.parametrize("arm", extend.ARMS)
def test_arms_start_from_the_base(arm):
    torch.manual_seed(0)
    base = extend._model(SMALL, 1, None)
    model = extend.arm_model(arm, base, SMALL)
    theirs = base.state_dict()
    for name, value in model.state_dict().items():
        if name in theirs:
            assert torch.equal(value, theirs[name]), name
    x = torch.randint(256, (1, 100))
    if arm.startswith("swa"):  # a window of base_len keys: the same as the base wherever T <= base_len
        assert torch.allclose(model(x[:, :32]), base(x[:, :32]), atol=1e-5)
        assert not torch.allclose(model(x)[:, 40:], base(x)[:, 40:], atol=1e-3)


class KeyReader(torch.nn.Module):
    """Reads the key where the text states it and predicts its digits at the
    question's end: what a model that retrieves perfectly does."""

    def forward(self, x):
        text = bytes(x[0].tolist())
        stated = text.index(b"pass key is ") + len(b"pass key is ")
        digits = text[stated:stated + 5]
        out = torch.zeros(1, x.shape[1], 256)
        # the last 5 predictions (positions -5..-1 of x) are the 5 digits, the first made after the question
        for i, d in enumerate(digits):
            out[0, x.shape[1] - 5 + i, d] = 1
        return out


class Zeros(torch.nn.Module):
    def forward(self, x):
        out = torch.zeros(1, x.shape[1], 256)
        out[..., ord("0")] = 1
        return out


def test_passkey_accuracy_scores_retrieval():
    filler = torch.randint(32, 127, (5000,), dtype=torch.uint8)
    assert extend.passkey_accuracy(KeyReader(), filler, 400, 8, 0) == 1.0
    assert extend.passkey_accuracy(Zeros(), filler, 400, 8, 0) < 0.5


def test_smoke_end_to_end(tmp_path):
    out = tmp_path / "lr.json"
    kept = {"task": "passkey", "arm": "swa", "seed": 0, "length": 1024}
    out.write_text(json.dumps({"records": [kept], "skipped": []}))
    extend.main(["--smoke", "--out", str(out), "--threads", "1"])
    results = json.loads(out.read_text())
    assert results["records"] == [kept]  # the other experiment's records are kept
    recs = results["extension"]
    assert [r["arm"] for r in recs] == ["base"] + list(extend.ARMS)
    assert recs[0]["length"] == 64 and recs[0]["passkey_accuracy"] is None  # too short for a passkey
    for r in recs[1:]:
        assert r["finetune_steps"] == (0 if r["arm"] == "swa" else 2)
        assert r["finetune_tokens"] * 10 <= r["base_tokens"]
        assert r["val_bits_per_byte"] > 0 and 0 <= r["passkey_accuracy"] <= 1
    shown = dict(results, records=[])  # (the kept record above is not a whole one)
    assert "| hkt_win | 256 |" in longrange.table_markdown(shown)  # docs/paper.md's table shows it
    with pytest.raises(SystemExit):
        extend.main(["--smoke", "--ft-steps", "100", "--out", str(out)])
