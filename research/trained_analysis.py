"""What a trained model learns: the paper's theory measured on trained weights and real activations.

    python -m research.trained_analysis --checkpoint results/listops512_ckpt/hkt_seed0.pt \\
        --out results/listops512_analysis
    python -m research.trained_analysis --checkpoint results/bytelm.pt --out results/bytelm_analysis

Loads a checkpoint of :mod:`research.long_run` (ListOps classifier,
``--kind listops``) or of :mod:`research.bytelm` / ``lm_run`` (byte-level
LM, ``--kind bytelm``; ``auto`` tells them apart), runs it on validation data
(the ListOps test set, or fixed windows of the standard-library validation
files) and captures the input of every :class:`hkt.MultiheadHKT` with forward
pre-hooks.  For every attention layer it reports, with the functions of
:mod:`hkt.analysis`:

- ``level_weights``: softmax(level_logits), [heads][levels];
- ``psd``: Prop 3.1's sufficient condition on the trained weights
  (:func:`~hkt.analysis.psd_condition`, with and without the projection
  biases), the smallest eigenvalue of each level's symmetrised form
  [levels][heads], and the largest difference between the query and key
  downsampling taps (the condition needs them equal);
- ``maps``: per-level score terms on the first ``--examples`` validation
  examples (:func:`~hkt.analysis.level_scores`) and their unique
  symmetric/antisymmetric split (Props 3.5-3.6,
  :func:`~hkt.analysis.split_symmetric`): each level's share of the score norm
  and the fraction of its energy in the symmetric part, [levels][heads]; the
  reconstruction error of sym + anti; how far the split of the scores is from
  the scores of the split forms (zero when the taps are shared); the
  eigenvalues of the combined kernel on the data
  (:func:`~hkt.analysis.kernel_eigenvalues`);
- ``approximation``: Thm 4.3's curve on the model's own activations: the
  relative error of the best L-level score model of head dim ``head_dim``
  fitted to the kernel X X^T of the layer's input X (real tokens of one
  example), L = 1 .. ``--max-levels``
  (:func:`~hkt.analysis.kernel_approximation_curve`), and as a control the same
  after a random permutation of the positions (which keeps the spectrum but
  destroys the multi-scale order the coarse levels rely on);
- ``at_init``: level weights, PSD and maps of the same run at step 0 (rebuilt
  with the run's seeded builder, on the same data), to tell what training
  changed from what the random initialisation already had.

Writes ``analysis.json`` and PNG plots (``weights_psd.png``,
``maps_layer<i>.png``, ``approximation_error.png``) to ``--out``.  The
checkpoint is copied to a temporary file before loading, so a training job may
keep rewriting it.  Scores are pre-mask: for a causal model only the lower
triangle reaches the softmax.
"""
import argparse
import math
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from hkt import analysis as A
from hkt import MultiheadHKT
from . import cli

__all__ = ["load_trained", "validation_tokens", "capture_attention_inputs", "analyse_layer", "analyse", "main"]

KINDS = ("auto", "listops", "bytelm")


def _read_checkpoint(path: str) -> Dict:
    """torch.load of a private copy: the training job replaces the file
    (os.replace) every few minutes, and we must never touch it."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint: no such file: {path!r}")
    fd, tmp = tempfile.mkstemp(suffix=".pt", prefix="hkt_analysis_")
    os.close(fd)
    try:
        shutil.copyfile(path, tmp)
        return torch.load(tmp, map_location="cpu", weights_only=False)
    finally:
        os.remove(tmp)


def _detect_kind(state: Dict, kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    found = "bytelm" if "model_config" in state else "listops" if "config" in state and "arm" in state else None
    if found is None:
        raise ValueError(f"checkpoint: neither a long_run nor a ByteLM checkpoint (keys {sorted(state)})")
    if kind != "auto" and kind != found:
        raise ValueError(f"kind: {kind!r} given, but the checkpoint is a {found} checkpoint")
    return found


def _untrained_model(kind: str, state: Dict) -> nn.Module:
    """The model of the checkpoint's run as it was at step 0 (the same seeded
    builder the training used), the reference for what training changed."""
    if kind == "listops":
        from .long_run import ARM_DEFAULTS, make_arm_model
        cfg = {**ARM_DEFAULTS, **state["config"]}
        # the saved config leaves out the ff widths; the run's own is saved apart
        cfg["matched_ff" if state["arm"].startswith("standard_ff") else "ff"] = state["ff"]
        return make_arm_model(cfg, state["arm"], state["seed"])
    from .bytelm import build_bytelm
    seed = (state.get("train_config") or {}).get("seed", state.get("seed", 0))
    return build_bytelm(seed, **state["model_config"])


def load_trained(path: str, kind: str = "auto") -> Tuple[nn.Module, nn.Module, Dict]:
    """(trained model, the same run's model at initialisation, info), both in
    eval mode; info holds the kind, the step, the last evaluation and what
    :func:`validation_tokens` needs."""
    state = _read_checkpoint(path)
    kind = _detect_kind(state, kind)
    hist = state.get("history") or []
    model = _untrained_model(kind, state)
    init = _untrained_model(kind, state)
    if kind == "listops":
        cfg = state["config"]
        info = {"arm": state["arm"], "seed": state["seed"], "step": state["step"], "steps": cfg["steps"],
                "config": dict(cfg, ff=state["ff"])}
    else:
        tc = state.get("train_config") or state.get("config") or {}
        corpus = state.get("corpus") or {}
        info = {"arm": state.get("arm", f"L{model.levels}"), "seed": tc.get("seed", state.get("seed")),
                "step": state.get("step", tc.get("steps")), "steps": tc.get("steps"),
                "config": dict(state["model_config"]), "seq_len": tc.get("seq_len"),
                "val_fraction": corpus.get("val_fraction", tc.get("val_fraction", 0.05)),
                "split_seed": corpus.get("seed", tc.get("split_seed", 0)),
                "trained_on_python": corpus.get("python_version")}
    model.load_state_dict(state["model"])
    info.update(kind=kind, checkpoint=path, last_eval=hist[-1] if hist else None)
    return model.eval(), init.eval(), info


def validation_tokens(info: Dict, n: int, seq_len: Optional[int] = None, data_root: Optional[str] = None
                      ) -> Tuple[Tensor, List[int], Dict]:
    """(tokens (n, T), real length of each row, description) of held-out data.

    ListOps: the first ``n`` test expressions of the run's test set (right
    padded with 0).  ByteLM: ``n`` fixed windows of the standard library's
    validation files (``seq_len`` bytes, default the training window; or the
    ``.py`` files under ``data_root``, as ``bytelm train --data-root``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an int >= 1, got {n!r}")
    if info["kind"] == "listops":
        from .train import load_task
        c = info["config"]
        # n_train=1: the test set depends only on its own seed, so skip generating the training set
        _, _, x, _ = load_task(c["task"], seq_len=seq_len or c["seq_len"], n_train=1, n_test=c["n_test"])
        x = x[:n]
        return x, (x != 0).sum(1).tolist(), {"source": f"{c['task']} test set (first {len(x)} examples)"}
    from .stdlib_bytes import describe, eval_windows, load_corpus
    corpus = load_corpus(data_root, val_fraction=info["val_fraction"], seed=info["split_seed"])
    T = seq_len or info["seq_len"] or 1024
    x, _ = eval_windows(corpus.val, T, n)
    desc = {"source": f"validation files of {describe(corpus.info)['root']}, {n} fixed windows of {T} bytes",
            "python_version": corpus.info["python_version"], "trained_on_python": info.get("trained_on_python")}
    return x, [T] * len(x), desc


@torch.no_grad()
def capture_attention_inputs(model: nn.Module, tokens: Tensor) -> Dict[str, Tuple[MultiheadHKT, Tensor]]:
    """{module name: (module, its query input (B, T, E) batch first)} for every
    MultiheadHKT, from one forward pass of ``model`` on ``tokens``."""
    found: Dict[str, Tuple[MultiheadHKT, Tensor]] = {}
    handles = []

    def hook_for(name):
        def hook(module, args, kwargs):
            q = args[0] if args else kwargs["query"]
            if q.dim() == 2:
                q = q.unsqueeze(0)
            elif not module.batch_first:
                q = q.transpose(0, 1)
            found[name] = (module, q.detach().clone())
        return hook

    for name, m in model.named_modules():
        if isinstance(m, MultiheadHKT):
            handles.append(m.register_forward_pre_hook(hook_for(name), with_kwargs=True))
    if not handles:
        raise ValueError("model: holds no hkt.MultiheadHKT to analyse")
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    return found


def _nan_to_none(t: Tensor) -> list:
    """t.tolist() with NaN as None: a level switched off (all-zero scores or
    form, as after hkt.swap_attention) has no fraction or eigenvalue ratio,
    and strict JSON has no NaN."""
    def fix(v):
        return [fix(u) for u in v] if isinstance(v, list) else (None if v != v else v)
    return fix(t.tolist())


@torch.no_grad()
def _psd_section(module: MultiheadHKT) -> Dict:
    p, p0 = A.psd_condition(module), A.psd_condition(module, bias=False)
    forms = A.bilinear_forms(module, dtype=torch.float64)
    scale = torch.linalg.eigvalsh((forms + forms.transpose(-1, -2)) / 2).abs().amax(-1)
    taps = 0.0 if module.levels == 1 else float((module.q_downsample - module.k_downsample).abs().max())
    return {"holds": p.holds, "holds_without_bias": p0.holds, "weights_convex": p.weights_convex,
            "shared_downsampling": p.shared_downsampling, "max_tap_difference": taps,
            "forms_psd": p.forms_psd.tolist(), "forms_psd_without_bias": p0.forms_psd.tolist(),
            "min_eigenvalue": p.min_eigenvalues.tolist(),
            # relative to the form's largest |eigenvalue|: comparable across levels and heads
            "relative_min_eigenvalue": _nan_to_none(p.min_eigenvalues / scale)}


@torch.no_grad()
def _maps_section(module: MultiheadHKT, xs: Sequence[Tensor]) -> Tuple[Dict, Tuple[Tensor, Tensor, Tensor]]:
    """Per-level score statistics averaged over the examples ``xs`` ((n_i, E)
    each), and (levels, sym, anti) of the first example for the plots."""
    L, H = module.levels, module.num_heads
    share, symf, antif = (torch.zeros(L, H, dtype=torch.float64) for _ in range(3))
    recon, forms_err, kmin, kneg = 0.0, 0.0, [], []
    first = None
    forms = A.bilinear_forms(module)
    sym_forms = (forms + forms.transpose(-1, -2)) / 2
    for x in xs:
        lv = A.level_scores(module, x).levels[:, 0].double()  # (L, H, n, n)
        sym, anti = A.split_symmetric(lv)
        if first is None:
            first = (lv, sym, anti)
        e = lv.square().sum((-1, -2))
        norms = e.sqrt()
        share += norms / norms.sum(0).clamp_min(1e-300)
        symf += sym.square().sum((-1, -2)) / e  # 0/0 = NaN for a switched-off level
        antif += anti.square().sum((-1, -2)) / e
        recon = max(recon, float((sym + anti - lv).abs().max() / lv.abs().max()))
        from_forms = A.level_scores_from_forms(module, x, sym_forms)[:, 0].double()
        forms_err = max(forms_err, float((from_forms - sym).abs().max() / lv.abs().max()))
        ev = A.kernel_eigenvalues(module, x)[0]  # (H, n)
        top = ev.abs().amax(-1)
        kmin.append(ev[:, 0] / top)
        kneg.append((ev < -1e-9 * top[:, None]).double().mean(-1))
    k = len(xs)
    return {"examples": k, "lengths": [int(x.shape[0]) for x in xs],
            "level_share": (share / k).tolist(), "symmetric_fraction": _nan_to_none(symf / k),
            "antisymmetric_fraction": _nan_to_none(antif / k), "reconstruction_error": recon,
            "split_of_forms_error": forms_err,
            "kernel_relative_min_eigenvalue": torch.stack(kmin).mean(0).tolist(),
            "kernel_negative_eigenvalue_fraction": torch.stack(kneg).mean(0).tolist()}, first


def _approximation_section(xs: Sequence[Tensor], rank: int, max_levels: int, sweeps: int, seed: int) -> Dict:
    kernels = [x.double() @ x.double().T for x in xs]
    g = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(K.shape[0], generator=g) for K in kernels]
    real = A.kernel_approximation_curve(kernels, rank=rank, max_levels=max_levels, sweeps=sweeps)
    shuffled = A.kernel_approximation_curve([K[p][:, p] for K, p in zip(kernels, perms)], rank=rank,
                                            max_levels=max_levels, sweeps=sweeps)
    return {"target": "X X^T, X the layer's attention input on the real tokens of one example", "rank": rank,
            "lengths": [int(x.shape[0]) for x in xs], "sweeps": sweeps, **real, "shuffled_positions": shuffled}


@torch.no_grad()
def analyse_layer(module: MultiheadHKT, xs: Sequence[Tensor], *, curve_examples: int = 4, max_levels: int = 6,
                  sweeps: int = 10, seed: int = 0, init: Optional[Tuple[MultiheadHKT, Sequence[Tensor]]] = None
                  ) -> Tuple[Dict, Tuple[Tensor, Tensor, Tensor]]:
    """Every section for one attention layer from its inputs ``xs`` ((n_i, E)
    per example); also the first example's (levels, sym, anti) for plotting.
    ``init``: (the layer at initialisation, its inputs) adds an ``at_init``
    section (weights, PSD and maps, no curve) to compare with."""
    if not isinstance(module, MultiheadHKT):
        raise TypeError(f"module: expected an hkt.MultiheadHKT, got {type(module).__name__}")
    if len(xs) == 0:
        raise ValueError("xs: expected at least one example")
    maps, first = _maps_section(module, xs)
    out = {"levels": module.levels, "heads": module.num_heads, "head_dim": module.head_dim,
           "level_weights": module.level_weights().tolist(), "psd": _psd_section(module), "maps": maps,
           "approximation": _approximation_section(xs[:curve_examples], module.head_dim, max_levels, sweeps, seed)}
    if init is not None:
        m0, xs0 = init
        out["at_init"] = {"level_weights": m0.level_weights().tolist(), "psd": _psd_section(m0),
                          "maps": _maps_section(m0, xs0)[0]}
    return out, first


@torch.no_grad()
def analyse(model: nn.Module, tokens: Tensor, lengths: Sequence[int], *, init_model: Optional[nn.Module] = None,
            curve_examples: int = 4, max_levels: int = 6, sweeps: int = 10, seed: int = 0
            ) -> Tuple[List[Dict], List[Tuple]]:
    """(per-layer results with their module names, per-layer first-example maps).
    ``init_model``: the same architecture untrained, analysed on the same tokens."""
    def real(x):  # real tokens only: padding is masked out anyway
        return [x[i, :n] for i, n in enumerate(lengths)]

    at_init = {} if init_model is None else capture_attention_inputs(init_model, tokens)
    layers, maps = [], []
    for name, (module, x) in capture_attention_inputs(model, tokens).items():
        init = (at_init[name][0], real(at_init[name][1])) if name in at_init else None
        res, first = analyse_layer(module, real(x), curve_examples=curve_examples, max_levels=max_levels,
                                   sweeps=sweeps, seed=seed, init=init)
        layers.append({"name": name, **res})
        maps.append(first)
    return layers, maps


# ----------------------------------------------------------------- plots

def _plot_weights_psd(layers: List[Dict], path: str) -> str:
    import matplotlib.pyplot as plt
    n = len(layers)
    fig, axes = plt.subplots(2, n, figsize=(3.6 * n, 6), squeeze=False)
    for i, lay in enumerate(layers):
        w = torch.tensor(lay["level_weights"])  # (H, L)
        ev = torch.tensor([[math.nan if v is None else v for v in row]
                           for row in lay["psd"]["relative_min_eigenvalue"]]).T  # (H, L)
        for ax, m, title, kw in ((axes[0, i], w, "level weights", dict(cmap="viridis", vmin=0, vmax=1)),
                                 (axes[1, i], ev, "min eig / max |eig| of sym(form)",
                                  dict(cmap="RdBu", vmin=-1, vmax=1))):
            ax.imshow(m.numpy(), aspect="auto", **kw)
            for h in range(m.shape[0]):
                for l in range(m.shape[1]):
                    v = float(m[h, l])
                    dark = v < 0.5 if kw["cmap"] == "viridis" else abs(v) > 0.6
                    ax.text(l, h, f"{v:.2f}", ha="center", va="center", fontsize=8,
                            color="white" if dark else "black")
            ax.set_xticks(range(m.shape[1]))
            ax.set_yticks(range(m.shape[0]))
            ax.set_xlabel("level")
            ax.set_ylabel("head")
            ax.set_title(f"{lay['name']}\n{title}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_maps(name: str, first: Tuple[Tensor, Tensor, Tensor], path: str, crop: int) -> str:
    """Rows: levels; per head three panels: the level's score term, its
    symmetric and its antisymmetric part, on one colour scale per row and head."""
    import matplotlib.pyplot as plt
    lv, sym, anti = (t[..., :crop, :crop] for t in first)
    L, H = lv.shape[:2]
    fig, axes = plt.subplots(L, 3 * H, figsize=(1.5 * 3 * H, 1.65 * L + 0.5), squeeze=False)
    for l in range(L):
        for h in range(H):
            vmax = float(lv[l, h].abs().max()) or 1.0
            for j, (m, what) in enumerate(((lv, "score"), (sym, "sym"), (anti, "anti"))):
                ax = axes[l, 3 * h + j]
                ax.imshow(m[l, h].numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
                ax.set_xticks([])
                ax.set_yticks([])
                ax.set_title(f"level {l} head {h} {what}", fontsize=7)
    fig.suptitle(f"{name}: per-level scores and their symmetric/antisymmetric parts "
                 f"(first {lv.shape[-1]} tokens of one validation example)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def write_plots(layers: List[Dict], maps: List[Tuple], out: str, crop: int = 64) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    paths = [_plot_weights_psd(layers, os.path.join(out, "weights_psd.png"))]
    for i, (lay, first) in enumerate(zip(layers, maps)):
        paths.append(_plot_maps(lay["name"], first, os.path.join(out, f"maps_layer{i}.png"), crop))
    curves = {}
    for i, lay in enumerate(layers):
        a = lay["approximation"]
        curves[f"layer {i}"] = a
        curves[f"layer {i}, positions shuffled"] = a["shuffled_positions"]
    paths.append(A.plot_approximation_error(curves, os.path.join(out, "approximation_error.png"),
                                            title=f"Best L-level fit of X X^T, X = attention input "
                                                  f"(rank {layers[0]['approximation']['rank']})"))
    return paths


# ------------------------------------------------------------------ CLI

def _summary(layers: List[Dict]) -> Dict:
    """A few headline numbers across layers (``*_at_init``: the same run at step 0)."""
    def mean(v):  # None (a switched-off level) is skipped; all None gives None
        v = [x for x in v if x is not None]
        return sum(v) / len(v) if v else None

    def per_level(get):
        return [mean([mean(get(lay)[l]) for lay in layers]) for l in range(layers[0]["levels"])]

    out = {
        "mean_level_weights": per_level(lambda lay: [[row[l] for row in lay["level_weights"]]
                                                     for l in range(lay["levels"])]),
        "psd_holds": [lay["psd"]["holds"] for lay in layers],
        "shared_downsampling": [lay["psd"]["shared_downsampling"] for lay in layers],
        "fraction_of_forms_psd": mean([mean([float(v) for row in lay["psd"]["forms_psd"] for v in row])
                                       for lay in layers]),
        "mean_level_share": per_level(lambda lay: lay["maps"]["level_share"]),
        "mean_symmetric_fraction_per_level": per_level(lambda lay: lay["maps"]["symmetric_fraction"]),
        "kernel_negative_eigenvalue_fraction": [mean(lay["maps"]["kernel_negative_eigenvalue_fraction"])
                                                for lay in layers],
        "approximation_error_at_L": {str(L): [lay["approximation"]["error"][L - 1] for lay in layers]
                                     for L in layers[0]["approximation"]["levels"]},
        "approximation_rate": [lay["approximation"]["rate"] for lay in layers],
        "shuffled_rate": [lay["approximation"]["shuffled_positions"]["rate"] for lay in layers],
    }
    if all("at_init" in lay for lay in layers):
        out.update({
            "fraction_of_forms_psd_at_init": mean([mean([float(v) for row in lay["at_init"]["psd"]["forms_psd"]
                                                         for v in row]) for lay in layers]),
            "mean_level_share_at_init": per_level(lambda lay: lay["at_init"]["maps"]["level_share"]),
            "mean_symmetric_fraction_per_level_at_init":
                per_level(lambda lay: lay["at_init"]["maps"]["symmetric_fraction"]),
            "kernel_negative_eigenvalue_fraction_at_init":
                [mean(lay["at_init"]["maps"]["kernel_negative_eigenvalue_fraction"]) for lay in layers],
        })
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    ap = argparse.ArgumentParser(prog="python -m research.trained_analysis", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a long_run, bytelm or lm_run checkpoint (read-only)")
    ap.add_argument("--kind", choices=KINDS, default="auto")
    ap.add_argument("--out", required=True, help="folder for analysis.json and the plots")
    ap.add_argument("--examples", type=int, default=8, help="validation examples for the maps statistics")
    ap.add_argument("--curve-examples", type=int, default=4, help="of those, how many for the Thm 4.3 curve")
    # two levels at least: the summary's rate per level compares consecutive levels
    ap.add_argument("--max-levels", type=cli.int_at_least(2), default=6, help="largest L of the Thm 4.3 curve")
    ap.add_argument("--sweeps", type=int, default=10, help="backfitting sweeps of best_level_fit")
    ap.add_argument("--seq-len", type=int, default=None, help="bytelm: window length (default: the training one)")
    ap.add_argument("--data-root", default=None, help="bytelm: read .py files here instead of the standard library")
    ap.add_argument("--crop", type=int, default=64, help="tokens shown in the map plots")
    ap.add_argument("--seed", type=int, default=0, help="of the position shuffle of the control curve")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    if args.curve_examples < 1 or args.curve_examples > args.examples:
        raise ValueError(f"curve_examples: expected 1..examples ({args.examples}), got {args.curve_examples}")
    torch.set_num_threads(args.threads)
    model, init_model, info = load_trained(args.checkpoint, args.kind)
    tokens, lengths, data = validation_tokens(info, args.examples, args.seq_len, args.data_root)
    layers, maps = analyse(model, tokens, lengths, init_model=init_model, curve_examples=args.curve_examples,
                           max_levels=args.max_levels, sweeps=args.sweeps, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    plots = [] if args.no_plots else [os.path.relpath(p, args.out) for p in write_plots(layers, maps, args.out,
                                                                                         args.crop)]
    res = {"command": "python -m research.trained_analysis " + " ".join(sys.argv[1:] if argv is None
                                                                                 else list(argv)),
           "checkpoint": info, "data": {**data, "lengths": lengths},
           "layout": {"level_weights": "[heads][levels]", "per-level statistics": "[levels][heads]",
                      "kernel_*": "[heads]", "approximation error": "[L - 1]"},
           "summary": _summary(layers), "layers": layers, "plots": plots}
    from .train import write_json
    write_json(res, os.path.join(args.out, "analysis.json"))
    s = res["summary"]
    print(f"{info['kind']} {info['arm']} seed {info['seed']} step {info['step']}: mean level weights "
          f"{[round(v, 3) for v in s['mean_level_weights']]}, PSD condition {s['psd_holds']}, "
          f"Thm 4.3 rate per level {[round(v, 3) for v in s['approximation_rate']]} "
          f"(shuffled {[round(v, 3) for v in s['shuffled_rate']]}); wrote {args.out}", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
