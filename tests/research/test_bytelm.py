"""research.stdlib_bytes / bytelm / lm_run: the standard-library corpus, the
byte-level language model, generation (with and without the attention cache), the
command line and a smoke run of the resumable comparison."""
import json
import math
import os
import shutil

import pytest
import torch

from research import bytelm, stdlib_bytes
from research.bytelm import ByteLM, bits_per_byte, build_bytelm, generate
from research.train import training_step
from helpers import one_thread  # noqa: F401  (autouse fixture: one torch thread)

TINY = dict(d_model=32, n_layers=2, n_heads=2, max_len=256)
NO_DECODE = "MultiheadHKT.init_cache / MultiheadHKT.decode (issue 13's incremental decoding API) not in hkt/nn/modules.py yet"


@pytest.fixture(scope="module")
def corpus():
    return stdlib_bytes.load_corpus()


# ---- corpus ----------------------------------------------------------------------------------------------------

def test_split_is_deterministic_disjoint_and_nonempty(corpus):
    again = stdlib_bytes.load_corpus()
    assert again.train_files == corpus.train_files and again.val_files == corpus.val_files
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)
    assert corpus.train_files and corpus.val_files
    assert not set(corpus.train_files) & set(corpus.val_files)
    assert sorted(corpus.train_files + corpus.val_files) == stdlib_bytes.list_sources()
    assert corpus.train_files == sorted(corpus.train_files)
    # the val fraction is about what was asked, and the bytes are the files' bytes
    n = len(corpus.train_files) + len(corpus.val_files)
    assert 0.01 < len(corpus.val_files) / n < 0.15
    root = stdlib_bytes.stdlib_dir()
    size = sum(os.path.getsize(os.path.join(root, f)) for f in corpus.val_files)
    assert corpus.val.numel() == size == corpus.info["val_bytes"]
    assert corpus.train.numel() > 10 * corpus.val.numel()
    assert corpus.info["python_version"].count(".") == 2
    assert not any(p.startswith(("site-packages/", "test/")) or "/tests/" in p for p in corpus.train_files)
    other = stdlib_bytes.load_corpus(seed=1)
    assert other.val_files != corpus.val_files  # the seed matters


def test_split_by_file_and_skipped_dirs(tmp_path):
    for rel in ["a.py", "pkg/b.py", "pkg/c.py", "site-packages/x.py", "test/t.py", "pkg/tests/t.py", "d.txt"]:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rel.encode() + b"\n")
    assert stdlib_bytes.list_sources(str(tmp_path)) == ["a.py", "pkg/b.py", "pkg/c.py"]
    before = {f: stdlib_bytes.is_validation(f, 0.5) for f in ["a.py", "pkg/b.py", "pkg/c.py"]}
    (tmp_path / "e.py").write_bytes(b"e\n")  # a new file moves no other file
    assert {f: stdlib_bytes.is_validation(f, 0.5) for f in before} == before
    with pytest.raises(ValueError, match="val_fraction"):
        stdlib_bytes.load_corpus(str(tmp_path), val_fraction=1.0)
    with pytest.raises(ValueError, match="val_fraction: the (train|val) split"):
        stdlib_bytes.load_corpus(str(tmp_path), val_fraction=1e-9)  # nothing in validation
    with pytest.raises(ValueError, match="root"):
        stdlib_bytes.list_sources(str(tmp_path / "missing"))


def test_sampler_is_seeded_and_shifted(corpus):
    a = stdlib_bytes.BatchSampler(corpus.train, 32, 4, seed=3)
    b = stdlib_bytes.BatchSampler(corpus.train, 32, 4, seed=3)
    c = stdlib_bytes.BatchSampler(corpus.train, 32, 4, seed=4)
    xa, ya = a.sample()
    xb, yb = b.sample()
    assert xa.shape == ya.shape == (4, 32) and xa.dtype == torch.int64
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, c.sample()[0])
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    state = a.state_dict()
    nxt = a.sample()
    a.load_state_dict(state)
    assert all(torch.equal(u, v) for u, v in zip(a.sample(), nxt))
    with pytest.raises(ValueError, match="data"):
        stdlib_bytes.BatchSampler(corpus.train[:10], 32, 4)


# ---- model -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("levels", [1, 3])
def test_forward_is_causal(levels):
    model = build_bytelm(0, levels=levels, **TINY).eval()
    x = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[:, 21] = (y[:, 21] + 1) % 256  # inside a level-2 block (positions 20..23)
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (2, 37, 256)
    torch.testing.assert_close(a[:, :21], b[:, :21], rtol=0, atol=1e-6)
    assert (a[:, 21:] - b[:, 21:]).abs().amax(-1).min() > 1e-4  # every later position sees the change


def test_arms_share_weights_except_coarse_levels():
    one, three = build_bytelm(5, levels=1, **TINY), build_bytelm(5, levels=3, **TINY)
    s1, s3 = one.state_dict(), three.state_dict()
    assert set(s1) < set(s3)
    for k in s1:
        assert torch.equal(s1[k], s3[k]), k
    assert not torch.equal(build_bytelm(6, levels=1, **TINY).embed.weight, one.embed.weight)


def test_training_reduces_loss_on_a_fixed_batch(corpus):
    model = build_bytelm(0, levels=3, **TINY)
    x, y = stdlib_bytes.BatchSampler(corpus.train, 64, 4, seed=0).sample()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    first = bits_per_byte(model(x), y).item()
    assert 7.0 < first < 11.0  # about log2(256) = 8 bits at initialisation
    for _ in range(30):
        training_step(model, opt, sched, bits_per_byte, x, y)
    assert bits_per_byte(model(x), y).item() < first - 2.0


def test_bad_model_arguments():
    with pytest.raises(ValueError, match="d_model"):
        ByteLM(d_model=0)
    with pytest.raises(ValueError, match="levels"):
        ByteLM(levels=0, **TINY)
    model = ByteLM(**TINY)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 257, dtype=torch.int64))
    with pytest.raises(TypeError, match="tokens"):
        model(torch.zeros(1, 4, dtype=torch.int32))


# ---- generation ------------------------------------------------------------------------------------------------

def test_greedy_generation_is_deterministic_and_argmax():
    model = build_bytelm(1, levels=3, **TINY)
    model.train()
    a = generate(model, b"def f(x):", 12, greedy=True, use_cache=False)
    b = generate(model, "def f(x):", 12, greedy=True, use_cache=False)
    assert a == b and len(a) == 12 and model.training  # the mode is restored
    # the first byte is the argmax after the prompt, the second the argmax after that
    seq = torch.tensor([list(b"def f(x):")])
    with torch.no_grad():
        model.eval()
        first = int(model(seq)[0, -1].argmax())
        second = int(model(torch.cat([seq, torch.tensor([[first]])], 1))[0, -1].argmax())
    assert a[:2] == bytes([first, second])


def test_sampling_follows_the_generator():
    model = build_bytelm(1, levels=2, **TINY)
    run = lambda s, **kw: generate(model, b"import ", 24, use_cache=False, generator=torch.Generator().manual_seed(s),
                                   **kw)
    assert run(0) == run(0)
    assert run(0) != run(1)
    assert run(0, top_k=1) == generate(model, b"import ", 24, greedy=True, use_cache=False)


def test_generate_rejects_bad_arguments():
    model = build_bytelm(0, **TINY)
    for kw, match in [(dict(prompt_bytes=b""), "prompt_bytes"), (dict(max_new_tokens=-1), "max_new_tokens"),
                      (dict(max_new_tokens=300), "max_len"), (dict(temperature=0.0), "temperature"),
                      (dict(top_k=0), "top_k")]:
        args = {"prompt_bytes": b"x", "max_new_tokens": 2, **kw}
        with pytest.raises(ValueError, match=match):
            generate(model, args.pop("prompt_bytes"), args.pop("max_new_tokens"), use_cache=False, **args)
    with pytest.raises(TypeError, match="prompt_bytes"):
        generate(model, [1, 2], 2, use_cache=False)
    assert generate(model, b"x", 0, use_cache=False) == b""


@pytest.mark.skipif(not bytelm.has_decode_api(), reason=NO_DECODE)
@pytest.mark.parametrize("levels", [1, 2, 3])
def test_cache_gives_the_same_greedy_tokens_and_logits(levels):
    model = build_bytelm(2, levels=levels, **TINY).eval()
    prompt = b"class A:\n    def f(self"  # 23 bytes: the prompt ends inside a coarse block
    with_cache = generate(model, prompt, 40, greedy=True, use_cache=True)
    assert with_cache == generate(model, prompt, 40, greedy=True, use_cache=False)
    # the logits themselves: prefill 23, then byte by byte, against one causal forward
    seq = torch.tensor([list(prompt + with_cache)])
    with torch.no_grad():
        full = model(seq)
        cache = model.init_cache(1, seq.shape[1])
        parts = [model.decode(seq[:, :23], cache)] + [model.decode(seq[:, t:t + 1], cache)
                                                       for t in range(23, seq.shape[1])]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="max_len"):
        model.decode(seq[:, :1], cache)  # the cache is full


def test_use_cache_without_the_api_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(bytelm, "has_decode_api", lambda: False)
    with pytest.raises(NotImplementedError, match="init_cache"):
        generate(build_bytelm(0, **TINY), b"x", 2, use_cache=True)


# ---- command line ----------------------------------------------------------------------------------------------

def test_cli_train_then_generate(tmp_path, capsys):
    ck = str(tmp_path / "lm.pt")
    bytelm.main(["train", "--d-model", "16", "--layers", "1", "--heads", "2", "--levels", "2", "--max-len", "128",
                 "--steps", "4", "--seq-len", "32", "--batch-size", "2", "--warmup", "1", "--eval-every", "2",
                 "--eval-windows", "2", "--out", ck, "--no-progress", "--threads", "1"])
    state = torch.load(ck, weights_only=False)
    assert [h["step"] for h in state["history"]] == [2, 4]
    assert all(math.isfinite(h["val_bpb"]) for h in state["history"])
    assert state["corpus"]["val_files"] > 0 and state["model_config"]["levels"] == 2
    capsys.readouterr()
    out = bytelm.main(["generate", "--checkpoint", ck, "--prompt", "def ", "--max-new-tokens", "8", "--threads", "1"])
    text = capsys.readouterr().out
    assert "greedy" in text and "sampled" in text and "tokens/s" in text
    assert len(out[("greedy", False)]) == 8
    if bytelm.has_decode_api():
        assert "identical with and without cache: True" in text


# ---- the resumable comparison (research.lm_run) ---------------------------------------------------------

LM_CFG = dict(seq_len=32, seeds=[0, 1], levels=[1, 3], steps=6, warmup=2, batch_size=2, d_model=16, layers=1,
              heads=2, eval_every=2, eval_windows=2, chunk=2)


def test_lm_run_resume_matches_uninterrupted(tmp_path, corpus):
    from research import lm_run
    cfg = {**lm_run.LM_DEFAULTS, **LM_CFG}
    val = stdlib_bytes.eval_windows(corpus.val, 32, 2)
    full = lm_run.new_run(cfg, "L3", 0, corpus.train)
    lm_run.train_steps(full, cfg, val, 6)
    part = lm_run.new_run(cfg, "L3", 0, corpus.train)
    lm_run.train_steps(part, cfg, val, 3)
    path = str(tmp_path / "ck.pt")
    lm_run.save_run(part, path, cfg, corpus)
    del part
    torch.manual_seed(12345)  # disturb the global RNG: the checkpoint restores it
    resumed = lm_run.load_run(path, cfg, "L3", 0, corpus)
    lm_run.train_steps(resumed, cfg, val, 10)
    assert resumed["step"] == full["step"] == 6
    for k, v in full["model"].state_dict().items():
        torch.testing.assert_close(resumed["model"].state_dict()[k], v, rtol=0, atol=0)
    strip = lambda hs: [{k: v for k, v in h.items() if k != "train_time"} for h in hs]
    assert strip(resumed["history"]) == strip(full["history"]) and [h["step"] for h in full["history"]] == [2, 4, 6]
    assert resumed["final"] == full["final"]
    assert bytelm.load_checkpoint(path).levels == 3  # a run's checkpoint is a ByteLM checkpoint
    with pytest.raises(ValueError, match="another configuration"):
        lm_run.load_run(path, {**cfg, "lr": 0.5}, "L3", 0, corpus)


def test_lm_run_command_resumes_and_writes_results(tmp_path):
    from research import lm_run
    common = ["--seq-len", "32", "--seeds", "0", "1", "--levels", "1", "3", "--steps", "4", "--warmup", "1",
              "--batch-size", "2", "--d-model", "16", "--layers", "1", "--heads", "2", "--eval-every", "2",
              "--eval-windows", "2", "--chunk", "2", "--no-progress", "--threads", "1"]
    argv = common + ["--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "r.json")]
    lm_run.main(argv + ["--max-steps", "6"])
    mid = json.loads((tmp_path / "r.json").read_text())
    assert mid["progress"]["steps_done"] == 6 and mid["progress"]["runs_finished"] == 1
    assert [(r["arm"], r["seed"], r["step"]) for r in mid["runs"]] == [("L1", 0, 4), ("L3", 0, 2), ("L1", 1, 0),
                                                                       ("L3", 1, 0)]
    res = lm_run.main(argv)  # resumes and finishes
    assert res["progress"]["runs_finished"] == 4 and res["progress"]["steps_done"] == 16
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved) >= {"config", "corpus", "arms", "progress", "time_per_step", "summary", "runs"}
    assert saved["arms"]["L1"]["levels"] == 1 and saved["arms"]["L3"]["levels"] == 3
    assert saved["arms"]["L3"]["params"] > saved["arms"]["L1"]["params"]
    assert {a: s["n"] for a, s in saved["summary"].items()} == {"L1": 2, "L3": 2}
    assert "L3_over_L1" in saved["time_per_step"] and saved["corpus"]["python_version"]
    for r in saved["runs"]:
        assert [h["step"] for h in r["history"]] == [2, 4] and 0 < r["val_bpb"] < 12
    try:
        import matplotlib  # noqa: F401  (optional: without it, no plot)
        assert (tmp_path / "r.png").stat().st_size > 0
    except ImportError:
        pass
    # equal wall-clock budgets: the slowest arm per step keeps --steps, the other gets more
    steps = lm_run.equal_time_steps(str(tmp_path / "r.json"), 100)
    tps = saved["time_per_step"]
    slow = max(("L1", "L3"), key=lambda a: tps[a])
    assert set(steps) == {"L1", "L3"} and steps[slow] == 100
    fast = "L1" if slow == "L3" else "L3"
    assert steps[fast] == round(100 * tps[slow] / tps[fast]) >= 100
    # or the fastest keeps --steps and the other gets fewer ...
    steps = lm_run.equal_time_steps(str(tmp_path / "r.json"), 4, anchor="fastest")
    assert steps[fast] == 4 and steps[slow] == round(4 * tps[fast] / tps[slow]) <= 4
    with pytest.raises(ValueError, match="anchor"):
        lm_run.equal_time_steps(str(tmp_path / "r.json"), 4, anchor="median")
    # ... and the fastest arm's finished equal-steps runs, copied over, are resumed as finished, not retrained
    (tmp_path / "ck_time").mkdir()
    for s in (0, 1):
        shutil.copy(tmp_path / "ck" / f"{fast}_seed{s}.pt", tmp_path / "ck_time" / f"{fast}_seed{s}.pt")
    timed = lm_run.main(common + ["--ckpt-dir", str(tmp_path / "ck_time"), "--out", str(tmp_path / "t.json"),
                                  "--equal-time-from", str(tmp_path / "r.json"), "--equal-time-anchor", "fastest"])
    by_run = {(r["arm"], r["seed"]): r for r in timed["runs"]}
    for s in (0, 1):
        assert by_run[(fast, s)]["history"] == next(r for r in saved["runs"] if (r["arm"], r["seed"]) == (fast, s))[
            "history"]  # the same run, read back
        assert by_run[(slow, s)]["step"] == steps[slow] and by_run[(slow, s)]["finished"]


def test_lm_run_dropout_resumed_in_pieces_is_bitwise_the_uninterrupted_one(tmp_path, corpus):
    from research import lm_run
    cfg = {**LM_CFG, "seeds": [0], "dropout": 0.1}
    lm_run.run_all(cfg, str(tmp_path / "full"), None, progress=False, corpus=corpus)
    for _ in range(5):  # stops mid-chunk: 3 steps of 2-step chunks a call
        lm_run.run_all(cfg, str(tmp_path / "part"), None, progress=False, corpus=corpus, max_steps=3)
    for arm in ("L1", "L3"):
        a = torch.load(tmp_path / "full" / f"{arm}_seed0.pt", weights_only=False)
        b = torch.load(tmp_path / "part" / f"{arm}_seed0.pt", weights_only=False)
        assert a["step"] == b["step"] == 6
        for k, v in a["model"].items():
            assert torch.equal(b["model"][k], v), (arm, k)
        assert [h["val_bpb"] for h in a["history"]] == [h["val_bpb"] for h in b["history"]]


def _small_root(tmp_path):
    root = tmp_path / "src"
    for i in range(12):
        (root / f"m{i}").mkdir(parents=True)
        (root / f"m{i}" / "a.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    return str(root)


def test_lm_run_refuses_a_checkpoint_of_another_corpus(tmp_path, corpus, capsys):
    from research import lm_run
    argv = ["--seq-len", "32", "--seeds", "0", "--levels", "1", "--steps", "4", "--warmup", "1", "--batch-size", "2",
            "--d-model", "16", "--layers", "1", "--heads", "2", "--eval-every", "2", "--eval-windows", "2",
            "--chunk", "2", "--no-progress", "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "r.json")]
    lm_run.main(argv + ["--max-steps", "2"])  # the standard library
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        lm_run.main(argv + ["--data-root", _small_root(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--ckpt-dir" in err and "corpus" in err and "data_root" in err
    # a checkpoint from before the corpus was recorded (the committed ones) is read as the standard library's ...
    path = tmp_path / "ck" / "L1_seed0.pt"
    state = torch.load(path, weights_only=False)
    del state["corpus"]
    torch.save(state, path)
    cfg = {**lm_run.LM_DEFAULTS, **LM_CFG, "levels": [1], "steps": 4, "warmup": 1}
    assert lm_run.load_run(str(path), cfg, "L1", 0, corpus)["step"] == 2
    # ... and refused for another corpus
    other = stdlib_bytes.load_corpus(_small_root(tmp_path / "b"))
    with pytest.raises(ValueError, match="corpus"):
        lm_run.load_run(str(path), cfg, "L1", 0, other)


def test_equal_time_from_needs_every_arm_from_an_lm_run_file(tmp_path, capsys):
    from research import lm_run
    lm_like = {"corpus": {}, "time_per_step": {"L1": 0.5, "L3": 0.6, "L3_over_L1": 1.2}}
    (tmp_path / "lm.json").write_text(json.dumps(lm_like))
    (tmp_path / "long.json").write_text(json.dumps({"config": {}, "time_per_step": {"hkt": 0.5, "standard": 0.4}}))
    assert lm_run.equal_time_steps(str(tmp_path / "lm.json"), 100, arms=["L1", "L3"]) == {"L1": 120, "L3": 100}
    with pytest.raises(ValueError, match=r"\['L2'\]"):
        lm_run.equal_time_steps(str(tmp_path / "lm.json"), 100, arms=["L1", "L2", "L3"])
    with pytest.raises(ValueError, match="not an research.lm_run results file"):
        lm_run.equal_time_steps(str(tmp_path / "long.json"), 100)
    base = ["--seq-len", "32", "--seeds", "0", "--levels", "1", "2", "3", "--steps", "4", "--d-model", "16",
            "--layers", "1", "--heads", "2", "--eval-windows", "2", "--batch-size", "2", "--no-progress",
            "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "o.json"), "--equal-time-from"]
    for name, needle in (("lm.json", "L2"), ("long.json", "not an research.lm_run"), ("none.json", "cannot read")):
        with pytest.raises(SystemExit) as e:
            lm_run.main(base + [str(tmp_path / name)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--equal-time-from" in err and needle in err, err
    assert not (tmp_path / "ck").exists()


def test_generate_cli_takes_the_prompt_bytes_and_prints_the_cached_text(tmp_path, capsys, monkeypatch):
    model = build_bytelm(0, d_model=16, n_layers=1, n_heads=2, levels=2, max_len=64)
    ck = str(tmp_path / "lm.pt")
    torch.save({"model": model.state_dict(), "model_config": model.config}, ck)
    # a byte that is not UTF-8, as the shell passes it (Python holds it as a surrogate)
    prompt = os.fsdecode(b"def \xff")
    out = bytelm.main(["generate", "--checkpoint", ck, "--prompt", prompt, "--max-new-tokens", "6"])
    assert out["prompt"] == b"def \xff"
    assert bytelm.main(["generate", "--checkpoint", ck, "--prompt", r"a\xff\n", "--escapes",
                        "--max-new-tokens", "1"])["prompt"] == b"a\xff\n"
    if not bytelm.has_decode_api():
        return
    # the text printed is the cached run's: make the two runs differ to see which one is shown
    monkeypatch.setattr(bytelm, "generate", lambda m, p, n, use_cache, **kw:
                        (b"C" if use_cache else b"R") * n)
    capsys.readouterr()
    bytelm.main(["generate", "--checkpoint", ck, "--prompt", "x", "--max-new-tokens", "3"])
    text = capsys.readouterr().out
    assert "xCCC" in text and "xRRR" not in text


def test_load_checkpoint_names_a_damaged_file(tmp_path):
    for name, content in (("empty.pt", b""), ("random.pt", bytes(range(256)) * 4)):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match="not a readable checkpoint") as e:
            bytelm.load_checkpoint(str(tmp_path / name))
        assert str(tmp_path / name) in str(e.value) and e.value.__cause__ is not None
    torch.save({"config": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other\.pt.*not a checkpoint"):
        bytelm.load_checkpoint(str(tmp_path / "other.pt"))


def test_lm_run_window_gives_the_hkt_arms_windows(tmp_path, corpus):
    from research import lm_run
    cfg = {**lm_run.LM_DEFAULTS, **LM_CFG, "window": 4}
    assert lm_run.arm_windows(cfg, 1) is None and lm_run.arm_windows(cfg, 3) == [4, 8, None]
    run = lm_run.new_run(cfg, "L3", 0, corpus.train)
    assert all(b.attn.windows == (4, 8, None) for b in run["model"].blocks)
    assert lm_run.new_run(cfg, "L1", 0, corpus.train)["model"].blocks[0].attn.windows is None
    val = stdlib_bytes.eval_windows(corpus.val, 32, 2)
    lm_run.train_steps(run, cfg, val, 2)
    path = str(tmp_path / "ck.pt")
    lm_run.save_run(run, path, cfg, corpus)
    assert bytelm.load_checkpoint(path).blocks[0].attn.windows == (4, 8, None)
    with pytest.raises(ValueError, match="another configuration"):  # the same run without windows is another one
        lm_run.load_run(path, {**cfg, "window": None}, "L3", 0, corpus)
    # the windowed model decodes as it runs forward
    model = bytelm.load_checkpoint(path).eval()
    x = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        cache = model.init_cache(1, 30)
        got = torch.cat([model.decode(x[:, :9], cache), model.decode(x[:, 9:], cache)], dim=1)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)

