"""What a clone carries: the tracked tree stays small, with no training
checkpoints but the one the generation example needs."""
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MB = 1_000_000


def _tracked():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if out.returncode != 0 or not out.stdout:
        pytest.skip("needs a git checkout")
    paths = [ROOT / p for p in out.stdout.decode().split("\0") if p]
    return {p: p.stat().st_size for p in paths if p.is_file()}


def test_tracked_tree_is_small():
    sizes = _tracked()
    assert sum(sizes.values()) <= 16 * MB, sorted(sizes.items(), key=lambda kv: -kv[1])[:5]


def test_at_most_one_small_checkpoint():
    ckpts = {p.relative_to(ROOT).as_posix(): n for p, n in _tracked().items() if p.suffix in (".pt", ".pth", ".ckpt")}
    assert len(ckpts) <= 1 and all(n <= 3 * MB for n in ckpts.values()), ckpts


def test_checkpoint_folders_are_ignored():
    for path in ("results/lm1024_ckpt/L1_seed0.pt", "results/listops512_ckpt/hkt_seed0.pt", "run.pt"):
        out = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert out.returncode == 0, f"{path} would be committed"
