"""The experiments' command lines: a bad option is an argparse error naming it
(exit code 2, no traceback), found before any training or generation starts.

Every call runs with the training entry points replaced by a function that
fails the test: a check that comes too late (or never, as with ``--chunk 0``,
which looped forever) fails fast instead of training or hanging."""
import pytest
import torch

from research import bytelm, listops_compare, lm_run, long_run, reproduce, theory
from research import train as train_cli
from helpers import one_thread  # noqa: F401  (autouse fixture: one torch thread)

LONG = ["--seq-len", "32", "--steps", "4", "--seeds", "0", "--d-model", "16", "--heads", "2", "--layers", "1",
        "--ff", "16", "--matched-ff", "24", "--n-train", "16", "--n-test", "8", "--no-progress"]
LM = ["--seq-len", "32", "--steps", "4", "--seeds", "0", "--levels", "1", "--d-model", "16", "--layers", "1",
      "--heads", "2", "--eval-windows", "2", "--batch-size", "2", "--no-progress"]
TRAIN = ["--seq-len", "32", "--steps", "2", "--d-model", "16", "--heads", "2", "--layers", "1", "--n-train", "16",
         "--n-test", "8", "--no-progress"]


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    def trained(*a, **k):
        raise AssertionError("training or generation started: the bad option was not caught up front")
    for mod, name in ((long_run, "train_in_turns"), (lm_run, "train_in_turns"), (train_cli, "train_classifier"),
                      (reproduce, "train_classifier"), (listops_compare, "train_classifier"),
                      (bytelm, "train_bytelm"), (bytelm, "_timed_generate"), (theory, "theory")):
        monkeypatch.setattr(mod, name, trained)


def _parser_error(capsys, main, argv, *needles):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("main,base", [(long_run.main, LONG), (lm_run.main, LM)], ids=["long_run", "lm_run"])
@pytest.mark.parametrize("bad", [["--chunk", "0"], ["--chunk", "-2"], ["--batch-size", "0"], ["--threads", "0"],
                                 ["--dropout", "1"], ["--dropout", "-0.1"], ["--heads", "3"], ["--seeds", "0", "0"],
                                 ["--steps", "0"]])
def test_resumable_drivers_reject_bad_options(tmp_path, capsys, main, base, bad):
    _parser_error(capsys, main, base + ["--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "o.json")] + bad,
                  bad[0])
    assert not (tmp_path / "ck").exists()


def test_long_run_levels_and_cifar_length(tmp_path, capsys):
    argv = LONG + ["--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "o.json")]
    _parser_error(capsys, long_run.main, argv + ["--levels", "0"], "--levels")
    _parser_error(capsys, long_run.main, argv + ["--task", "cifar", "--seq-len", "512"], "--seq-len", "1024")
    # no data there: says so, naming --data-dir, and where to put the batches
    _parser_error(capsys, long_run.main, argv[2:] + ["--task", "cifar", "--data-dir", str(tmp_path / "none")],
                  "--data-dir", "cifar-10-batches-py")


@pytest.mark.parametrize("main,extra", [(train_cli.main, []), (reproduce.main, ["--seeds", "0"]),
                                        (listops_compare.main, [])], ids=["train", "reproduce", "listops_compare"])
@pytest.mark.parametrize("bad", [["--steps", "0"], ["--steps", "-5"], ["--n-train", "0"], ["--n-test", "0"],
                                 ["--batch-size", "0"], ["--heads", "3"], ["--threads", "0"], ["--levels", "0"],
                                 ["--dropout", "1.5"], ["--seq-len", "3"]])
def test_training_commands_reject_bad_options(tmp_path, capsys, main, extra, bad):
    out = [] if main is listops_compare.main else ["--out", str(tmp_path / "o.json")]
    _parser_error(capsys, main, TRAIN + extra + out + bad, bad[0])


@pytest.mark.parametrize("main,extra", [(train_cli.main, []), (reproduce.main, ["--seeds", "0"])],
                         ids=["train", "reproduce"])
def test_unwritable_out_is_refused_before_training(tmp_path, capsys, main, extra):
    _parser_error(capsys, main, TRAIN + extra + ["--out", str(tmp_path)], "--out", "directory")
    _parser_error(capsys, main, TRAIN + extra + ["--out", "/proc/hkt_results.json"], "--out", "cannot write")
    (tmp_path / "file").write_text("x")
    _parser_error(capsys, main, TRAIN + extra + ["--out", str(tmp_path / "file" / "o.json")], "--out")
    assert (tmp_path / "file").read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_missing_data_dir_and_cifar_length(tmp_path, capsys):
    for task in ("cifar", "imdb"):
        _parser_error(capsys, train_cli.main, TRAIN[2:] + ["--task", task, "--data-dir", str(tmp_path / "none")],
                      "--data-dir")
    _parser_error(capsys, train_cli.main, TRAIN + ["--task", "cifar"], "--seq-len", "1024")


def test_reproduce_rejects_repeated_seeds(tmp_path, capsys):
    _parser_error(capsys, reproduce.main, TRAIN + ["--seeds", "0", "0", "--out", str(tmp_path / "o.json")],
                  "--seeds", "repeated")
    with pytest.raises(ValueError, match="seeds"):
        reproduce.reproduce("listops", seeds=[1, 1])


def test_theory_rejects_bad_numbers(tmp_path, capsys):
    for bad in (["--max-levels", "0"], ["--T", "0"], ["--threads", "0"]):
        _parser_error(capsys, theory.main, ["--out", str(tmp_path)] + bad, bad[0])


def test_bytelm_train_rejects_bad_options(tmp_path, capsys):
    base = ["train", "--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len", "32", "--no-progress",
            "--out", str(tmp_path / "lm.pt")]
    for bad in (["--steps", "0"], ["--batch-size", "0"], ["--heads", "3"], ["--threads", "0"], ["--levels", "0"]):
        _parser_error(capsys, bytelm.main, base + bad, bad[0])
    _parser_error(capsys, bytelm.main, base[:-2] + ["--out", str(tmp_path)], "--out")


@pytest.fixture
def tiny_checkpoint(tmp_path):
    model = bytelm.build_bytelm(0, d_model=16, n_layers=1, n_heads=2, levels=2, max_len=64)
    path = str(tmp_path / "lm.pt")
    torch.save({"model": model.state_dict(), "model_config": model.config}, path)
    return path


def test_bytelm_generate_rejects_bad_options_before_generating(tmp_path, capsys, tiny_checkpoint):
    base = ["generate", "--checkpoint", tiny_checkpoint, "--max-new-tokens", "4"]
    for bad, flag in ((["--temperature", "0"], "--temperature"), (["--temperature", "-1"], "--temperature"),
                      (["--top-k", "0"], "--top-k"), (["--max-new-tokens", "-1"], "--max-new-tokens"),
                      (["--escapes", "--prompt", "\\u20ac"], "--prompt"), (["--escapes", "--prompt", "\\x4"], "--prompt"),
                      (["--max-new-tokens", "100"], "--max-new-tokens"), (["--threads", "0"], "--threads")):
        _parser_error(capsys, bytelm.main, base + bad, flag)
    (tmp_path / "junk.pt").write_bytes(b"\x00junk" * 10)
    _parser_error(capsys, bytelm.main, ["generate", "--checkpoint", str(tmp_path / "junk.pt")], "--checkpoint",
                  "junk.pt", "not a readable checkpoint")
