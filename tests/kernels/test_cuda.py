"""The CUDA kernels (csrc/cuda/hkt_attention_cuda.cu) against the CPU kernels and the
float64 reference.

GPU tests skip unless torch sees a GPU and hkt._C was built with HKT_CUDA=1.

The test_emulated_* tests (opt-in: HKT_TEST_CUDA_EMULATION=1, needs gcc and g++,
no GPU, ~1 min) compile the same .cu as host C++ against a small shim that runs
a block's threads as fibers meeting at every shuffle, __syncwarp, mma and
__syncthreads, link it into a copy of the binding that sends CPU arrays to the
_cuda entry points, and compare with the CPU kernels.  That checks the kernels'
logic (indexing, masks, dropout hash, overwrite, dw and dmask reductions,
non-finite values) and their warp-uniform control flow: the shim reports, as a
kernel error, lanes of one warp that meet at different shuffles or
__syncwarp()s, a lane that returns while the others wait at one, and threads
waiting for others that never come.  It does not check the GPU itself: memory
model, launch limits, streams.
"""
import concurrent.futures
import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import hkt
from hkt import _C, ops
from hkt._core.kernels import dropout_keep_mask
from hkt.reference import hkt_attention_reference as reference

from helpers import MASKS, make_mask, sample_inputs

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and _C.has_cuda),
                               reason="needs a CUDA GPU and hkt built with HKT_CUDA=1")

# (B, H, T, S, D, Dv, L): T = 1, 97, 130; S != T; L = 1..4; D, Dv below and above a warp
SIZES = [
    (1, 1, 1, 1, 3, 5, 1),
    (2, 3, 1, 7, 5, 3, 3),
    (1, 2, 7, 7, 4, 9, 2),
    (2, 2, 97, 130, 13, 7, 3),
    (1, 3, 130, 97, 9, 11, 4),
    (1, 2, 97, 97, 40, 33, 2),
    (1, 1, 130, 257, 64, 64, 1),
]
def leaves_on(tensors, device, dtype=None):
    return [x.detach().to(device=device, dtype=dtype or x.dtype).requires_grad_() for x in tensors]


def out_and_grads(q, k, v, w, gout, backend="kernels", **kw):
    """out and the gradients of q.., k.., v, w (and of attn_mask when it requires grad);
    the kernels unless asked otherwise (backend=None picks "sdpa" on CUDA)."""
    out = hkt.hkt_attention(q, k, v, w, backend=backend, **kw)
    am = kw.get("attn_mask")
    leaves = [*q, *k, v, w] + ([am] if am is not None and am.requires_grad else [])
    return [out, *torch.autograd.grad(out, leaves, gout.to(device=out.device, dtype=out.dtype))]


def assert_all_close(got, want, rtol, atol, equal_nan=False):
    assert len(got) == len(want)
    for x, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.detach().cpu().to(b.dtype), b.detach().cpu(), rtol=rtol, atol=atol,
                                   equal_nan=equal_nan, msg=lambda m: f"output {x} (out, [lse,] dq.., dk.., dv, dw"
                                   f"[, dmask]): {m}")


def split(xs, L):
    return list(xs[:L]), list(xs[L:2 * L]), xs[2 * L], xs[2 * L + 1]


# ---- shared by the GPU and the emulated tests

def takes_dmask(mod):
    return "dmask" in (mod.backward.__doc__ or "")


def scratch_for(q, lse):
    """The CUDA backward's workspace (the binding ignores it on the CPU), filled
    with garbage: the kernels must not depend on what it holds."""
    B, H, T = lse.shape
    n = _C.cuda_scratch_bytes(B, H, T, len(q), lse.element_size())
    return torch.full((n,), 0xFF, dtype=torch.uint8, device=lse.device)


def run_binding(mod, q, k, v, w, dout, mask, causal, scale, dp, seed, dmask=False):
    """forward then backward through a binding, into outputs prefilled with
    garbage (both must overwrite); with dmask, also the float mask's gradient
    (an array shaped like the mask)."""
    B, H, T, _ = q[0].shape
    dt, dev = q[0].dtype, q[0].device
    out = torch.full((B, H, T, v.shape[3]), 7.0, dtype=dt, device=dev)
    lse = torch.full((B, H, T), 7.0, dtype=dt, device=dev)
    mod.forward(q, k, v, w, out, lse, mask, causal, scale, dp, seed, 2)
    dq = [torch.full(tuple(x.shape), 5.0, dtype=dt, device=dev) for x in q]
    dk = [torch.full(tuple(x.shape), 5.0, dtype=dt, device=dev) for x in k]
    dv = torch.full(tuple(v.shape), 5.0, dtype=dt, device=dev)
    dw = torch.full(tuple(w.shape), 5.0, dtype=dt, device=dev)
    extra = [torch.full(tuple(mask.shape), 5.0, dtype=dt, device=dev)] if dmask else []
    mod.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, mask, causal, scale, dp, seed, 2,
                 **({"dmask": extra[0]} if dmask else {}), scratch=scratch_for(q, lse))
    return [out, lse, *dq, *dk, dv, dw, *extra]


# ---- non-finite values (hkt.h): each case is inputs plus what the contract says of them

NON_FINITE = ["nan_k_one_visible", "nan_k_one_visible_L2", "nan_q_rows_causal", "nan_k_hidden_causal",
              "nan_k_masked_out", "nan_q_masked_row", "float_mask_non_finite", "nan_w_one_head", "inf_q_dropout"]


# Cases where a hidden entry has a non-finite q, k or w.  hkt.h: a hidden entry
# "contributes nothing to anything", which the CUDA kernels keep (and the
# `finite` check below tests); the CPU kernels and the reference multiply its
# dS = 0 by that q, k or w in their products, so their dq, dk or dw may hold
# NaN where the CUDA ones are finite (for the CPU, only where the entry shares
# a tile with others).  For these, CUDA is compared with the CPU where the CPU
# is not NaN, and NaN in CUDA's gradients must be NaN in the CPU's.
HIDDEN_NON_FINITE = {"nan_q_rows_causal", "nan_k_hidden_causal", "nan_k_masked_out", "nan_q_masked_row",
                     "nan_w_one_head"}


def non_finite_case(name, dtype):
    """(args for run_binding, nan_rows, empty_rows, finite) where nan_rows and
    empty_rows (B, H, T) are the rows whose out and lse must be NaN, and 0 and
    +inf (every other row is finite); finite is None or (the same args with
    every hidden non-finite value made finite, [(output index, index)]): those
    outputs must not change, hidden entries adding nothing to anything."""
    g = torch.Generator().manual_seed(11)
    nan, inf = float("nan"), float("inf")

    def inputs(B, H, T, S, D, Dv, L):
        rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)
        return ([rnd(B, H, -(-T // 2**l), D) for l in range(L)], [rnd(B, H, -(-S // 2**l), D) for l in range(L)],
                rnd(B, H, S, Dv), rnd(H, L), rnd(B, H, T, Dv))

    mask, causal, dp, keep = None, False, 0.0, None
    if name.startswith("nan_k_one_visible"):  # each row sees key 5 alone, whose k holds a NaN
        T, S, L = (1, 32, 1) if name == "nan_k_one_visible" else (3, 45, 2)
        q, k, v, w, dout = inputs(1, 1, T, S, 3, 2, L)
        mask = torch.zeros(1, 1, T, S, dtype=torch.bool)
        mask[..., 5] = True
        k[0][0, 0, 5, 1] = nan
        nan_rows = torch.ones(1, 1, T, dtype=torch.bool)
    elif name == "nan_q_rows_causal":
        q, k, v, w, dout = inputs(1, 2, 37, 37, 4, 3, 3)
        causal = True
        q[0][0, 1, 9, 2] = nan  # row 9 of head 1
        q[2][0, 0, 3, 0] = nan  # rows 12..15 of head 0
        nan_rows = torch.zeros(1, 2, 37, dtype=torch.bool)
        nan_rows[0, 1, 9] = nan_rows[0, 0, 12:16] = True
    elif name == "nan_k_hidden_causal":  # key 39 is seen by row 39 alone
        q, k, v, w, dout = inputs(1, 1, 40, 40, 4, 3, 2)
        causal = True
        k[0][0, 0, 39, 0] = nan
        nan_rows = torch.zeros(1, 1, 40, dtype=torch.bool)
        nan_rows[..., 39] = True
        keep = [(0, (..., slice(0, 39), slice(None))), (1, (..., slice(0, 39))),  # out, lse of rows 0..38
                (2, (..., slice(0, 39), slice(None))), (3, (..., slice(0, 19), slice(None)))]  # their dq
    elif name == "nan_k_masked_out":  # key 20 hidden from every row by the bool mask
        q, k, v, w, dout = inputs(2, 1, 20, 33, 4, 3, 2)
        mask = torch.rand(1, 1, 20, 33, generator=g) > 0.3
        mask[..., 20] = False
        k[0][1, 0, 20, :] = nan
        nan_rows = torch.zeros(2, 1, 20, dtype=torch.bool)
        keep = "all"
    elif name == "nan_q_masked_row":  # a row with no visible key, its q NaN
        q, k, v, w, dout = inputs(1, 2, 20, 33, 4, 3, 1)
        mask = torch.ones(1, 2, 20, 33, dtype=torch.bool)
        mask[0, 1, 6] = False
        q[0][0, 1, 6, 0] = nan
        nan_rows = torch.zeros(1, 2, 20, dtype=torch.bool)
        keep = "all"
    elif name == "float_mask_non_finite":
        q, k, v, w, dout = inputs(1, 2, 20, 20, 4, 3, 2)
        mask = torch.randn(1, 2, 20, 20, generator=g, dtype=dtype)
        mask[0, 0, 3, 5] = inf    # a visible +inf: row NaN
        mask[0, 1, 7, 2] = nan    # a visible NaN: row NaN
        mask[0, 0, 11] = -inf     # every key hidden: out 0, lse +inf
        mask[0, 1, :, 4] = -inf   # one key hidden from every row
        nan_rows = torch.zeros(1, 2, 20, dtype=torch.bool)
        nan_rows[0, 0, 3] = nan_rows[0, 1, 7] = True
    elif name == "nan_w_one_head":
        q, k, v, w, dout = inputs(1, 2, 10, 12, 4, 3, 2)
        causal = True
        w[1, 1] = nan
        nan_rows = torch.zeros(1, 2, 10, dtype=torch.bool)
        nan_rows[0, 1] = True
    elif name == "inf_q_dropout":  # +inf in q: scores +-inf or NaN, so the row is NaN
        q, k, v, w, dout = inputs(2, 1, 9, 14, 5, 3, 2)
        q[0][1, 0, 2] = inf
        dp = 0.3
        nan_rows = torch.zeros(2, 1, 9, dtype=torch.bool)
        nan_rows[1, 0, 2] = True
    else:
        raise ValueError(name)
    B, H, T = nan_rows.shape
    S = v.shape[2]
    empty = torch.zeros(B, H, T, dtype=torch.bool)
    if mask is not None:
        visible = mask.expand(B, H, T, S) if mask.dtype == torch.bool else mask.expand(B, H, T, S) != -inf
        if causal:
            visible = visible & torch.ones(T, S, dtype=torch.bool).tril()
        empty = ~visible.any(-1)
    args = (q, k, v, w, dout, mask, causal, 0.4, dp, 5)
    finite = None
    if keep is not None:
        fix = lambda x: torch.nan_to_num(x, nan=0.5, posinf=0.5, neginf=0.5)
        L = len(q)
        finite = (([fix(x) for x in q], [fix(x) for x in k], v, w, dout, mask, causal, 0.4, dp, 5),
                  [(x, (...,)) for x in range(2 * L + 4)] if keep == "all" else keep)
    return args, nan_rows, empty, finite


def check_non_finite(got, nan_rows, empty):
    out, lse = got[0], got[1].cpu()
    out = out.cpu()
    fine = ~(nan_rows | empty)
    assert out[nan_rows].isnan().all() and lse[nan_rows].isnan().all(), "rows that see a NaN/+inf score: NaN"
    assert (out[empty] == 0).all() and (lse[empty] == float("inf")).all(), "rows with no visible key: 0, +inf"
    assert out[fine].isfinite().all() and lse[fine].isfinite().all(), "every other row finite"


def run_non_finite(mod, name, dtype, device="cpu"):
    """run_binding on one NON_FINITE case; checks what the contract fixes and
    returns (results, the CPU's results)."""
    args, nan_rows, empty, finite = non_finite_case(name, dtype)
    on = lambda a: tuple([x.to(device) for x in y] if isinstance(y, list) else
                         y.to(device) if isinstance(y, torch.Tensor) else y for y in a)
    dmask = args[5] is not None and args[5].is_floating_point() and takes_dmask(mod)
    got = run_binding(mod, *on(args), dmask=dmask)
    check_non_finite(got, nan_rows, empty)
    if name.startswith("nan_k_one_visible"):  # the NaN key's gradients are NaN, the hidden keys' exactly 0
        L = len(args[0])
        dk0, dv = got[2 + L].cpu(), got[2 + 2 * L].cpu()
        assert dk0[..., 5, :].isnan().all() and (dk0[..., :5, :] == 0).all() and (dk0[..., 6:, :] == 0).all()
        assert dv[..., 5, :].isnan().all() and (dv[..., :5, :] == 0).all() and (dv[..., 6:, :] == 0).all()
        assert got[2].isnan().all() and got[-1].isnan().all()  # dq[0] and dw
    if finite is not None:
        fargs, parts = finite
        ref = run_binding(mod, *on(fargs), dmask=dmask)
        for x, at in parts:
            torch.testing.assert_close(got[x][at], ref[x][at], rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"output {x} changed by a hidden non-finite value: {m}")
    want = run_binding(_C, *args, dmask=dmask)
    return got, want


def assert_like_cpu(got, want, name, L, tol):
    """assert_all_close with equal NaN, except that in HIDDEN_NON_FINITE cases the
    CPU's dq, dk and dw may hold NaN where CUDA's are finite."""
    if name not in HIDDEN_NON_FINITE:
        return assert_all_close(got, want, tol, tol, equal_nan=True)
    got, want = list(got), list(want)
    for x in [*range(2, 2 + 2 * L), 2 + 2 * L + 1]:  # dq.., dk.., dw
        a, b = got[x].detach().cpu().to(want[x].dtype), want[x]
        assert not (a.isnan() & ~b.isnan()).any(), f"output {x}: NaN on CUDA, not on the CPU"
        got[x], want[x] = a[~b.isnan()], b[~b.isnan()]
    assert_all_close(got, want, tol, tol, equal_nan=True)


DMASK_SHAPES = [(2, 2, 13, 17), (1, 2, 13, 17), (1, 1, 13, 17), (2, 1, 1, 17), (1, 1, 13, 1), (1, 1, 1, 1)]


def dmask_args(shape, dtype, causal, dropout_p):
    B, H, T, S, D, Dv, L = 2, 2, 13, 17, 4, 3, 2
    g = torch.Generator().manual_seed(21)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    q = [rnd(B, H, -(-T // 2**l), D) for l in range(L)]
    k = [rnd(B, H, -(-S // 2**l), D) for l in range(L)]
    mask = rnd(*shape)
    if mask.numel() > 1:
        mask.view(-1)[::7] = float("-inf")  # hidden entries; for (1, 1, 13, 1) whole rows
    return (q, k, rnd(B, H, S, Dv), rnd(H, L), rnd(B, H, T, Dv), mask, causal, 0.4, dropout_p, 8)


def mask_grad_reference(q, k, v, w, dout, mask, causal, scale, dropout_p, seed):
    assert dropout_p == 0
    m = mask.detach().double().requires_grad_()
    out = reference([x.double() for x in q], [x.double() for x in k], v.double(), w.double(), attn_mask=m,
                    is_causal=causal, scale=scale)
    return torch.autograd.grad(out, m, dout.double())[0]


# --------------------------------------------------------------------------- on a GPU

@needs_gpu
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [False, True])
def test_float64_matches_cpu_and_reference(size, mask, causal):
    B, H, T, S, D, Dv, L = size
    q, k, v, w = sample_inputs(*size, per_head=(T % 2 == 1))
    am = make_mask(mask, B, H, T, S, torch.float64)
    gout = torch.randn(B, H, T, Dv, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    # a float mask (1, H, T, S) requires grad: dmask, summed over B
    mask_on = lambda dev: None if am is None else am.to(dev).requires_grad_(mask == "float")
    cpu = leaves_on([*q, *k, v, w], "cpu")
    gpu = leaves_on([*q, *k, v, w], "cuda")
    want = out_and_grads(*split(cpu, L), gout, attn_mask=mask_on("cpu"), is_causal=causal)
    ref_mask = mask_on("cpu")
    ref = [reference(*split(cpu, L), attn_mask=ref_mask, is_causal=causal)]
    ref += torch.autograd.grad(ref[0], cpu + ([ref_mask] if mask == "float" else []), gout)
    got = out_and_grads(*split(gpu, L), gout, attn_mask=mask_on("cuda"), is_causal=causal)
    assert got[0].device.type == "cuda"
    assert_all_close(got, want, 1e-10, 1e-10)
    assert_all_close(got, ref, 1e-10, 1e-10)


@needs_gpu
@pytest.mark.parametrize("size", SIZES[2:6], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("mask", [None, "float"])
def test_float32_matches_reference(size, per_head, mask):
    B, H, T, S, D, Dv, L = size
    q, k, v, w = sample_inputs(*size, per_head=per_head)
    am = make_mask(mask, B, H, T, S, torch.float64)
    gout = torch.randn(B, H, T, Dv, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cpu64 = leaves_on([*q, *k, v, w], "cpu")
    ref = [reference(*split(cpu64, L), attn_mask=am, is_causal=True, scale=0.3)]
    ref += torch.autograd.grad(ref[0], cpu64, gout)
    gpu = leaves_on([*q, *k, v, w], "cuda", torch.float32)
    am32 = None if am is None else am.float().cuda()
    got = out_and_grads(*split(gpu, L), gout, attn_mask=am32, is_causal=True, scale=0.3)
    assert got[0].dtype == torch.float32
    assert_all_close(got, ref, 1e-4, 1e-4)
    cpu32 = leaves_on([*q, *k, v, w], "cpu", torch.float32)
    want = out_and_grads(*split(cpu32, L), gout, attn_mask=None if am is None else am.float(), is_causal=True,
                         scale=0.3)
    assert_all_close(got, want, 1e-4, 1e-4)


@needs_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_same_seed_same_entries_on_cpu_and_gpu(causal):
    B, H, T, S, D, Dv, L, p = 2, 2, 97, 130, 5, 4, 3, 0.3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L)
    gout = torch.randn(B, H, T, Dv, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    results = []
    for device, seed in [("cpu", torch.tensor(1234)), ("cuda", torch.tensor(1234)),
                         ("cuda", torch.tensor(1234, device="cuda"))]:
        xs = leaves_on([*q, *k, v, w], device)
        qd, kd, vd, wd = split(xs, L)
        out, lse = torch.ops.hkt.attention_forward(qd, kd, vd, wd, None, causal, p, 0.4, seed)
        results.append([out, lse, *torch.autograd.grad(out, xs, gout.to(device))])
    for got in results[1:]:
        assert_all_close(got, results[0], 1e-10, 1e-10)
    # and it is the documented pattern: the reference with dropout_keep_mask
    keep = dropout_keep_mask(1234, p, B, H, T, S)
    cpu = leaves_on([*q, *k, v, w], "cpu")
    ref = reference(*split(cpu, L), is_causal=causal, dropout_p=p, scale=0.4, dropout_mask=keep)
    torch.testing.assert_close(results[1][0].cpu(), ref.detach(), rtol=1e-10, atol=1e-10)
    other, _ = torch.ops.hkt.attention_forward(*split(leaves_on([*q, *k, v, w], "cuda"), L), None, causal, p,
                                               0.4, torch.tensor(1235))
    assert not torch.equal(other, results[1][0])


@needs_gpu
def test_non_contiguous_inputs():
    B, H, T, S, D, Dv, L = 2, 3, 29, 23, 6, 5, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, device="cuda")
    qt = [x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in q]
    kt = [x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in k]
    vt = torch.cat([v, v], dim=-1)[..., ::2].detach().requires_grad_()
    wt = w.t().contiguous().t().requires_grad_()
    assert not qt[1].is_contiguous() and not vt.is_contiguous() and not wt.is_contiguous()
    gout = torch.randn(B, H, T, Dv, dtype=torch.float64)
    got = out_and_grads(qt, kt, vt, wt, gout, is_causal=True)
    cpu = leaves_on([*qt, *kt, vt, wt], "cpu")
    want = out_and_grads(*split(cpu, L), gout, is_causal=True)
    assert_all_close(got, want, 1e-10, 1e-10)


@needs_gpu
def test_empty_rows_and_no_keys():
    B, H, T, S = 1, 2, 20, 30
    q, k, v, w = sample_inputs(B, H, T, S, 4, 3, 3, device="cuda", requires_grad=True)
    mask = torch.ones(T, S, dtype=torch.bool, device="cuda")
    mask[3] = False
    out, lse = ops.attention_forward(q, k, v, w, mask.expand(B, H, T, S), False, 0.0, 0.5, torch.tensor(0))
    assert (out[:, :, 3] == 0).all() and torch.isinf(lse[:, :, 3]).all() and torch.isfinite(lse[:, :, 4]).all()
    gq0 = torch.autograd.grad(out.sum(), q[0])[0]
    assert torch.isfinite(gq0).all() and (gq0[:, :, 3] == 0).all() and (gq0[:, :, 4] != 0).any()
    q, k, v, w = sample_inputs(1, 1, 5, 0, 4, 3, 2, device="cuda", requires_grad=True)
    out = hkt.hkt_attention(q, k, v, w, backend="kernels")
    assert out.shape == (1, 1, 5, 3) and (out == 0).all()
    gq0, gw = torch.autograd.grad(out.sum(), [q[0], w])
    assert (gq0 == 0).all() and (gw == 0).all()


@needs_gpu
def test_backward_overwrites_and_is_deterministic():
    B, H, T, S, D, Dv, L = 2, 3, 150, 140, 16, 8, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, dtype=torch.float32, device="cuda", per_head=False)
    out = torch.empty(B, H, T, Dv, device="cuda")
    lse = torch.empty(B, H, T, device="cuda")
    _C.forward(q, k, v, w, out, lse, None, True)
    dout = torch.randn_like(out)
    runs = []
    for fill in (float("nan"), 123.0):
        dq = [torch.full(x.shape, fill, device="cuda") for x in q]
        dk = [torch.full(x.shape, fill, device="cuda") for x in k]
        dv, dw = torch.full(v.shape, fill, device="cuda"), torch.full(w.shape, fill, device="cuda")
        _C.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, None, True)
        runs.append([*dq, *dk, dv, dw])
    for a, b in zip(*runs):
        assert torch.isfinite(a).all() and torch.equal(a, b)  # no NaN left over, bitwise run to run


@needs_gpu
def test_wrong_device_is_a_clean_error():
    q, k, v, w = sample_inputs(1, 2, 9, 7, 3, 4, 2, device="cuda")
    out = torch.empty(1, 2, 9, 4, dtype=torch.float64)  # on the CPU
    with pytest.raises(ValueError, match="out"):
        _C.forward(q, k, v, w, out, torch.empty(1, 2, 9, dtype=torch.float64, device="cuda"))
    for backend in ("kernels", "sdpa"):
        with pytest.raises(ValueError, match="w"):
            hkt.hkt_attention(q, k, v, w.cpu(), backend=backend)


@needs_gpu
def test_inputs_from_a_side_stream():
    # the kernels run on torch's current stream: inputs written there earlier are complete
    q, k, v, w = sample_inputs(2, 2, 300, 300, 32, 32, 3, dtype=torch.float32)
    want = hkt.hkt_attention(q, k, v, w, is_causal=True)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(3):
            big = big @ big / 64  # keep the stream busy
        qg, kg = [x.cuda() * 1 for x in q], [x.cuda() * 1 for x in k]
        got = hkt.hkt_attention(qg, kg, v.cuda() * 1, w.cuda() * 1, is_causal=True, backend="kernels")
    torch.cuda.synchronize()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


@needs_gpu
def test_kernels_queue_on_the_current_stream_without_waiting():
    # forward and backward return while their stream is still busy (no device or
    # stream synchronization), and they run in that stream's order: after the
    # sleep, before the copy to the host that follows them there
    B, H, T, S, D, Dv, L = 2, 2, 200, 180, 16, 16, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, dtype=torch.float32)
    gout = torch.randn(B, H, T, Dv, generator=torch.Generator().manual_seed(1))
    cpu = leaves_on([*q, *k, v, w], "cpu")
    want = out_and_grads(*split(cpu, L), gout, is_causal=True)
    warm = leaves_on([*q, *k, v, w], "cuda")  # first calls load the kernels
    out_and_grads(*split(warm, L), gout.cuda(), is_causal=True)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        gpu = leaves_on([*q, *k, v, w], "cuda")
        gg = gout.cuda()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time queued before hkt's kernels
        out = hkt.hkt_attention(*split(gpu, L), is_causal=True, backend="kernels")
        assert not s.query(), "the forward waited for its stream"
        grads = torch.autograd.grad(out, gpu, gg)
        assert not s.query(), "the backward waited for its stream"
        got = [x.to("cpu", non_blocking=False) for x in (out, *grads)]
    s.synchronize()
    assert_all_close(got, want, 1e-4, 1e-5)


def _graph_case(backend, mask_kind):
    B, H, T, S, D, Dv, L = 2, 2, 77, 77, 8, 8, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, dtype=torch.float32, device="cuda", requires_grad=True)
    mask = None
    if mask_kind == "float":
        mask = torch.randn(1, H, T, S, device="cuda").requires_grad_()
    elif mask_kind == "bool":
        mask = torch.rand(T, S, device="cuda") > 0.3
    gout = torch.randn(B, H, T, Dv, device="cuda")
    leaves = [*q, *k, v, w] + ([mask] if mask_kind == "float" else [])

    def step():
        out = hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=True, backend=backend)
        return [out, *torch.autograd.grad(out, leaves, gout)]

    return leaves, gout, step


@needs_gpu
@pytest.mark.parametrize("backend", ["kernels", "sdpa"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_cuda_graph_capture_and_replay(backend, mask_kind):
    # forward + backward captured by torch.cuda.graph: capture fails if anything
    # synchronizes or calls cudaMalloc; each replay on new input values must give
    # what an eager call gives
    leaves, gout, step = _graph_case(backend, mask_kind)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch's docs ask
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = step()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        with torch.no_grad():
            for x in leaves:
                x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            gout.copy_(torch.randn(gout.shape, device="cuda", generator=gen))
        g.replay()
        want = step()
        for a, b in zip(static, want):
            # the kernels are bitwise deterministic; SDPA's CUDA backward may add with atomics
            assert torch.equal(a, b) if backend == "kernels" else torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@needs_gpu
def test_dropout_is_refused_under_capture():
    q, k, v, w = sample_inputs(1, 2, 33, 33, 8, 8, 2, dtype=torch.float32, device="cuda")
    hkt.hkt_attention(q, k, v, w, dropout_p=0.2)  # warm-up
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="dropout_p: hkt's dropout cannot be captured"):
        with torch.cuda.graph(g):
            hkt.hkt_attention(q, k, v, w, dropout_p=0.2)


def _compiled_steps(backend, steps=6):
    """(compiled results, eager results) of `steps` forward+backward calls of a
    torch.compile(mode="reduce-overhead") function on fresh input values."""
    B, H, T, S, D, Dv, L = 2, 2, 64, 64, 8, 8, 3
    mask = torch.rand(1, 1, T, S, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) > 0.2

    def f(q0, q1, q2, k0, k1, k2, v, w):
        out = hkt.hkt_attention([q0, q1, q2], [k0, k1, k2], v, w, attn_mask=mask, is_causal=True, backend=backend)
        return out.square().sum()

    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    got, want = [], []
    for step in range(steps):
        q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, dtype=torch.float32, device="cuda", seed=step,
                                   requires_grad=True)
        xs = [*q, *k, v, w]
        for fn, res in ((compiled, got), (f, want)):
            loss = fn(*xs)
            res.append([loss.detach().clone(), *[g.clone() for g in torch.autograd.grad(loss, xs)]])
    return got, want


@needs_gpu
@pytest.mark.parametrize("backend", ["kernels", "sdpa"])
def test_compiled_reduce_overhead(backend):
    # with the cudagraph_unsafe tag (hkt/ops.py) the hkt ops run between inductor's
    # CUDA graphs; the sdpa backend is plain torch and is captured whole
    torch._dynamo.reset()
    got, want = _compiled_steps(backend)
    for a, b in zip(got, want):
        assert_all_close(a, b, 1e-4, 1e-4)


_UNTAGGED_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import hkt
from hkt import ops
from hkt._core import kernels as _kernels
assert ops._TAGS == (), "HKT_CUDAGRAPH_SAFE=1 did not drop the tag"
calls = {"n": 0}
for name in ("_forward", "_backward"):
    orig = getattr(_kernels, name)
    def counted(*a, _orig=orig, **kw):
        calls["n"] += 1
        return _orig(*a, **kw)
    setattr(_kernels, name, counted)
from test_cuda import _compiled_steps, assert_all_close
got, want = _compiled_steps("kernels", steps=6)
for a, b in zip(got, want):
    assert_all_close(a, b, 1e-4, 1e-4)
print(json.dumps({"calls": calls["n"]}))
"""


@needs_gpu
def test_compiled_reduce_overhead_captures_untagged_ops(tmp_path):
    # The test that decides whether hkt/ops.py may drop torch.Tag.cudagraph_unsafe:
    # with HKT_CUDAGRAPH_SAFE=1 the ops are registered without it, and under
    # torch.compile(mode="reduce-overhead") inductor must then capture them in its
    # CUDA graphs: results equal eager ones on every step, and the ops' Python code
    # runs only while inductor warms up and records (6 steps x (compiled + eager)
    # calls; eager alone is 12 forward + 12 backward calls, replays add none).
    env = dict(os.environ, HKT_CUDAGRAPH_SAFE="1")
    here = Path(__file__).resolve().parents[1]  # tests/, for helpers
    res = subprocess.run([sys.executable, "-c", _UNTAGGED_SCRIPT, str(here)], env=env, cwd=here,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    calls = json.loads(res.stdout.strip().splitlines()[-1])["calls"]
    eager = 12  # forward + backward of the 6 eager steps
    # warm-up and recording run the op's Python a few times; replays do not
    assert calls <= eager + 6, f"the ops ran {calls - eager} times in 6 compiled steps: not captured"


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu():
    # torch's __dlpack__ refuses tensors off the current device, so select it
    q, k, v, w = sample_inputs(1, 2, 33, 40, 8, 8, 3)
    want = hkt.hkt_attention(q, k, v, w, is_causal=True)
    with torch.cuda.device(1):
        got = hkt.hkt_attention([x.to("cuda:1") for x in q], [x.to("cuda:1") for x in k], v.to("cuda:1"),
                                w.to("cuda:1"), is_causal=True)
    assert got.device == torch.device("cuda:1")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-10)


@needs_gpu
def test_bfloat16_and_module_on_gpu():
    q, k, v, w = sample_inputs(1, 2, 45, 38, 8, 8, 3, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    ref = reference(*[[x.detach().double().cpu() for x in xs] for xs in (q, k)], v.detach().double().cpu(),
                    w.detach().double().cpu(), is_causal=True)
    for backend, tol in (("kernels", 1e-2), ("sdpa", 3e-2), (None, 3e-2)):
        out = hkt.hkt_attention(q, k, v, w, is_causal=True, backend=backend)
        assert out.dtype == torch.bfloat16 and out.device.type == "cuda"
        torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol)

    torch.manual_seed(0)
    m = hkt.MultiheadHKT(16, 4, levels=3, batch_first=True, dtype=torch.float64)
    mg = copy.deepcopy(m).cuda()
    x = torch.randn(2, 37, 16, dtype=torch.float64)
    y, _ = m(x, x, x, need_weights=False, is_causal=True, attn_mask=torch.ones(37, 37).triu(1).bool())
    yg, _ = mg(x.cuda(), x.cuda(), x.cuda(), need_weights=False, is_causal=True,
               attn_mask=torch.ones(37, 37, device="cuda").triu(1).bool())
    torch.testing.assert_close(yg.cpu(), y, rtol=1e-10, atol=1e-10)
    y.sum().backward()
    yg.sum().backward()
    for a, b in zip(mg.parameters(), m.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-9, atol=1e-10)


@needs_gpu
@pytest.mark.parametrize("size", [(2, 4, 2, 300, 257, 64, 64, 3), (1, 2, 2, 129, 100, 128, 128, 4),
                                  (1, 2, 1, 64, 33, 32, 40, 1)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_tensor_cores_on_gpu(monkeypatch, size, causal):
    """The bfloat16 tensor-core kernels on the GPU: the forward against the
    float64 reference, bitwise repeatable, and the backward (on tensor cores
    where D and Dv are at most 64, else in float32) against the reference's."""
    monkeypatch.setattr(hkt._core.kernels, "cuda_tensor_cores", True)
    B, H, Hk, T, S, D, Dv, L = size
    q, k, v, w = _bf16_inputs(size, 3)
    q, k = [x.cuda().requires_grad_() for x in q], [x.cuda().requires_grad_() for x in k]
    v, w = v.cuda().requires_grad_(), w.cuda().requires_grad_()
    assert hkt._core.kernels._cuda_tc(q, v, 0.0)
    assert hkt._core.kernels._cuda_tc(q, v, 0.0, True) == (D <= 64 and Dv <= 64 and Dv % 16 == 0)
    out = hkt.hkt_attention(q, k, v, w, is_causal=causal, backend="kernels")
    again = hkt.hkt_attention(q, k, v, w, is_causal=causal, backend="kernels")
    assert torch.equal(out, again)
    d = lambda x: x.detach().double().cpu().requires_grad_()  # noqa: E731
    q64, k64, v64, w64 = [d(x) for x in q], [d(x) for x in k], d(v), d(w)
    ref = reference(q64, k64, v64, w64, is_causal=causal)
    # out is bfloat16: its own rounding (2^-9 relative) on top of P's
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=2.0**-8, atol=2.0**-8 * float(v.abs().max()))
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    leaves = (*q, *k, v, w)
    grads = torch.autograd.grad(out, leaves, gout.cuda())
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(again, leaves, gout.cuda())))
    ref.backward(gout.double())
    for got, want in zip(grads, (*q64, *k64, v64, w64)):
        scale = float(want.grad.abs().max()) + 1e-6
        assert float((got.double().cpu() - want.grad).abs().max()) < 3e-2 * scale


@needs_gpu
def test_opcheck_on_gpu():
    q, k, v, w = sample_inputs(1, 2, 11, 9, 3, 4, 2, device="cuda", requires_grad=True)
    mask = torch.rand(1, 2, 11, 9, device="cuda") > 0.2
    torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, mask, True, 0.0, 0.5, torch.tensor(5)))


@needs_gpu
@pytest.mark.parametrize("name", NON_FINITE)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_non_finite_values_like_cpu(name, dtype):
    # NON_FINITE, run_non_finite: below, shared with the emulation
    got, want = run_non_finite(_C, name, dtype, "cuda")
    assert got[0].device.type == "cuda"
    assert_like_cpu(got, want, name, (len(got) - 4) // 2, 1e-10 if dtype == torch.float64 else 1e-4)


@needs_gpu
@pytest.mark.parametrize("shape", [(2, 2, 13, 17), (1, 2, 13, 17), (2, 1, 1, 17), (1, 1, 1, 1)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_dmask_like_cpu(shape, causal, dropout_p):
    if not takes_dmask(_C):
        pytest.skip("the binding has no dmask yet")
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        args = dmask_args(shape, dtype, causal, dropout_p)
        gpu = tuple([x.cuda() for x in a] if isinstance(a, list) else a.cuda() if isinstance(a, torch.Tensor) else a
                    for a in args)
        got = run_binding(_C, *gpu, dmask=True)
        assert_all_close(got, run_binding(_C, *args, dmask=True), tol, tol)
        if dropout_p == 0 and dtype == torch.float64:
            torch.testing.assert_close(got[-1].cpu(), mask_grad_reference(*args), rtol=1e-10, atol=1e-10)
        runs = [run_binding(_C, *gpu, dmask=True)[-1] for _ in range(2)]
        assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], got[-1])  # bitwise run to run


# --------------------------------------------------------------------------- emulated, no GPU

_EMULATE = os.environ.get("HKT_TEST_CUDA_EMULATION", "0") == "1"

_SHIM = r"""
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <source_location>
#include <string>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static
typedef int cudaError_t;
typedef struct emu_stream *cudaStream_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, emuErrorDivergentWarp = 2 };
enum cudaDeviceAttr { cudaDevAttrComputeCapabilityMajor = 75 };
struct emu_dim { unsigned x; };
/* the emulated thread that runs now: emu_launch sets it at every switch */
inline emu_dim threadIdx, blockIdx;
inline emu_dim blockDim, gridDim;

inline std::atomic<bool> emu_failed{false};
inline std::string emu_msg;
inline void emu_fail(const char *what, long tag_a, long tag_b) {
    if (emu_failed.exchange(true)) return;
    char buf[256];
    snprintf(buf, sizeof buf, "emulated warp %u of block %u, lane %u: %s (at line %ld / line %ld)",
             threadIdx.x >> 5, blockIdx.x, threadIdx.x & 31, what, tag_a / 64, tag_b / 64);
    emu_msg = buf;
}

/* A block's threads are fibers (ucontext) on the launching thread, run one at
 * a time by emu_launch: each runs until it waits to meet others (a shuffle,
 * __syncwarp, an mma, __syncthreads) or returns, then the next one runs, in
 * ascending order on one pass and descending on the next, so that a thread
 * that reads what another writes without a meeting between them reads it
 * too early one way or the other.  The same checks as threads that block,
 * with no OS threads to start and wake: a shuffle had woken 31 threads
 * twice, and these tests took half of make test. */
struct emu_fiber {
    ucontext_t ctx;
    bool done;
};
inline std::vector<emu_fiber> emu_fibers;
inline ucontext_t emu_sched;
inline std::function<void()> emu_body;
inline uint64_t emu_progress; /* arrivals and returns: a pass without one is a deadlock */
inline void emu_yield() { swapcontext(&emu_fibers[threadIdx.x].ctx, &emu_sched); }

/* n threads that meet: each meeting carries a tag (the source line of the
 * operation, and a shuffle's offset); the first misuse -- threads at different
 * operations, or a wait for threads that never come -- is recorded, every
 * later meeting of that launch passes straight through (so all threads
 * finish), and cudaGetLastError reports it. */
struct emu_barrier {
    unsigned arrived = 0;
    uint64_t generation = 0;
    long tag = 0;
    void meet(long t, unsigned n, const char *what) {
        if (arrived > 0 && tag != t) {
            emu_fail(what, tag, t);
            return;
        }
        if (arrived == 0) tag = t;
        emu_progress++;
        if (++arrived == n) {
            arrived = 0;
            generation++;
            return;
        }
        const uint64_t gen = generation;
        while (generation == gen && !emu_failed) emu_yield();
    }
};

/* A warp: 32 threads that meet at every shuffle, __syncwarp and mma; also a
 * lane at one after another lane returned, or a lane returning while others
 * wait, is a misuse. */
struct emu_warp : emu_barrier {
    unsigned live = 32;
    uint64_t slot[32];
    uint32_t frag[32][6]; /* emu_mma_m16n8k16_bf16: each lane's a0..a3, b0, b1 */
};
inline std::vector<std::unique_ptr<emu_warp>> emu_warps;
inline emu_warp &emu_my_warp() { return *emu_warps[threadIdx.x >> 5]; }
inline void emu_meet(long tag) {
    emu_warp &w = emu_my_warp();
    if (emu_failed) return;
    if (w.live != 32) {
        emu_fail("reached a warp-wide operation after another lane of its warp returned", tag, tag);
        return;
    }
    w.meet(tag, 32, "lanes of one warp met at different warp-wide operations");
}
inline void emu_leave() {
    emu_warp &w = emu_my_warp();
    w.live--;
    if (w.arrived > 0 && !emu_failed) emu_fail("returned while other lanes of its warp wait", w.tag, w.tag);
}
inline void __syncwarp(unsigned = 0xffffffffu, std::source_location at = std::source_location::current()) {
    emu_meet((long)at.line() * 64);
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T x, int o, std::source_location at = std::source_location::current()) {
    emu_warp &w = emu_my_warp();
    const long tag = (long)at.line() * 64 + o;
    std::memcpy(&w.slot[threadIdx.x & 31], &x, sizeof x);
    emu_meet(tag);
    T y;
    std::memcpy(&y, &w.slot[(threadIdx.x & 31) ^ o], sizeof y);
    emu_meet(tag);
    return y;
}
/* __syncthreads: every thread of the block meets (the same call), as at a
 * warp-wide operation */
inline emu_barrier emu_blk;
inline void __syncthreads(std::source_location at = std::source_location::current()) {
    if (emu_failed) return;
    emu_blk.meet((long)at.line() * 64, blockDim.x, "threads of one block met at different __syncthreads");
}
/* mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a b, written from
 * the PTX ISA's description of its fragments (g = lane / 4, t = lane % 4; two
 * elements per 32-bit register, the lower-indexed in the low half):
 *   a0 A[g][2t..], a1 A[g+8][2t..], a2 A[g][2t+8..], a3 A[g+8][2t+8..]
 *   b0 B[2t..][g] (rows 2t, 2t+1), b1 B[2t+8..][g]
 *   d0, d1 D[g][2t], D[g][2t+1]; d2, d3 D[g+8][2t], D[g+8][2t+1]
 * Products of bfloat16 are exact in float; they are summed in k order. */
inline void emu_mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                  std::source_location at = std::source_location::current()) {
    emu_warp &w = emu_my_warp();
    const int me = threadIdx.x & 31;
    const long tag = (long)at.line() * 64 + 63;
    for (int x = 0; x < 4; x++) w.frag[me][x] = a[x];
    w.frag[me][4] = b[0];
    w.frag[me][5] = b[1];
    emu_meet(tag);
    auto bf = [](uint32_t bits) { float f; uint32_t u = bits << 16; std::memcpy(&f, &u, 4); return f; };
    float A[16][16], B[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3;
        const uint32_t *f = w.frag[lane];
        for (int u = 0; u < 2; u++) {
            A[g][2 * t + u] = bf(f[0] >> (16 * u) & 0xffffu);
            A[g + 8][2 * t + u] = bf(f[1] >> (16 * u) & 0xffffu);
            A[g][2 * t + 8 + u] = bf(f[2] >> (16 * u) & 0xffffu);
            A[g + 8][2 * t + 8 + u] = bf(f[3] >> (16 * u) & 0xffffu);
            B[2 * t + u][g] = bf(f[4] >> (16 * u) & 0xffffu);
            B[2 * t + 8 + u][g] = bf(f[5] >> (16 * u) & 0xffffu);
        }
    }
    const int g = me >> 2, t = me & 3;
    for (int x = 0; x < 4; x++) {
        const int r = g + (x & 2 ? 8 : 0), c = 2 * t + (x & 1);
        float acc = 0.f;
        for (int k = 0; k < 16; k++) acc += A[r][k] * B[k][c];
        d[x] += acc;
    }
    emu_meet(tag); /* nobody writes the next fragments before every lane has read these */
}
inline cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr, int) { *v = 8; return 0; }
/* blocks run one after another (function-static "shared" arrays are then per
 * block); at most 3 of them, so the kernels' task loops are exercised.  The
 * launch is synchronous: the stream only has to be passed. */
inline void emu_fiber_main() {
    emu_body();
    emu_leave();
    emu_fibers[threadIdx.x].done = true;
    emu_progress++;
} /* back to emu_sched (uc_link) */
template <typename K, typename A>
inline void emu_launch(K kernel, unsigned grid, unsigned block, size_t shmem, cudaStream_t, const A &a) {
    if (shmem) { std::fprintf(stderr, "emulation: dynamic shared memory is not emulated\n"); std::abort(); }
    /* 1 MiB a thread, its pages taken as touched, below it a page that faults:
     * a thread that outgrows its stack stops the test, not another's stack */
    constexpr size_t page = 4096, stack_bytes = 1 << 20;
    static std::vector<char *> stacks; /* kept for the next launch */
    while (stacks.size() < block) {
        char *m = (char *)mmap(nullptr, page + stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED || mprotect(m, page, PROT_NONE)) { std::perror("emulation: a thread's stack"); std::abort(); }
        stacks.push_back(m + page);
    }
    gridDim.x = grid < 3 ? grid : 3;
    blockDim.x = block;
    emu_body = [&] { kernel(a); };
    for (unsigned b = 0; b < gridDim.x; b++) {
        blockIdx.x = b;
        emu_warps.clear();
        for (unsigned w = 0; w < (block + 31) / 32; w++) emu_warps.emplace_back(new emu_warp);
        emu_blk = emu_barrier();
        emu_fibers.assign(block, emu_fiber());
        for (unsigned t = 0; t < block; t++) {
            ucontext_t &c = emu_fibers[t].ctx;
            getcontext(&c);
            c.uc_stack.ss_sp = stacks[t];
            c.uc_stack.ss_size = stack_bytes;
            c.uc_link = &emu_sched;
            makecontext(&c, emu_fiber_main, 0);
        }
        for (unsigned left = block, pass = 0; left > 0; pass++) {
            const uint64_t before = emu_progress;
            for (unsigned i = 0; i < block; i++) {
                const unsigned t = pass % 2 ? block - 1 - i : i;
                if (emu_fibers[t].done) continue;
                threadIdx.x = t;
                swapcontext(&emu_sched, &emu_fibers[t].ctx);
                if (emu_fibers[t].done) left--;
            }
            if (left > 0 && emu_progress == before) /* all that are left wait, for threads that never come */
                emu_fail("waits to meet threads that never come", emu_blk.arrived ? emu_blk.tag : 0, 0);
        }
    }
    emu_body = nullptr;
}
/* a recorded misuse is the launch's error; reading it clears it */
inline cudaError_t emu_take_error() { return emu_failed.exchange(false) ? emuErrorDivergentWarp : cudaSuccess; }
inline cudaError_t cudaGetLastError() { return emu_take_error(); }
inline cudaError_t cudaGetDevice(int *d) { *d = 0; return 0; }
inline cudaError_t cudaSetDevice(int) { return 0; }
inline const char *cudaGetErrorString(cudaError_t e) {
    return e == emuErrorDivergentWarp ? emu_msg.c_str() : e ? "invalid argument" : "no error";
}
inline const char *cudaGetErrorName(cudaError_t e) {
    return e == emuErrorDivergentWarp ? "emuErrorDivergentWarp" : e ? "cudaErrorInvalidValue" : "cudaSuccess";
}
"""


def skip_without_emulation():
    """Skips unless the emulation is asked for and gcc and a C++20 g++ are there
    (a compiler without them is nothing to emulate with, not a failure of hkt)."""
    if not _EMULATE:
        pytest.skip("set HKT_TEST_CUDA_EMULATION=1 to run the CUDA kernels emulated on the CPU")
    if not (shutil.which("g++") and shutil.which("gcc")):
        pytest.skip("the emulation needs gcc and g++")
    probe = subprocess.run(["g++", "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input="#include <source_location>\n",
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"the emulation needs g++ with -std=c++20: {probe.stderr.strip()[:200]}")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    skip_without_emulation()
    csrc = Path(__file__).resolve().parents[2] / "csrc"
    d = tmp_path_factory.mktemp("cuda_emulation")
    (d / "inc").mkdir()
    (d / "inc" / "cuda_runtime.h").write_text(_SHIM)
    # kernel<real[, N]><<<grid, block, shmem, stream>>>(args): every launch names its stream
    cu, n = re.subn(r"(\w+<[\w, ]+>)<<<([^,]+),\s*([^,]+),\s*([^,]+),\s*(\w+)>>>\((\w+)\)",
                    r"emu_launch(\1, \2, \3, \4, \5, \6)", (csrc / "cuda" / "hkt_attention_cuda.cu").read_text())
    assert n >= 7 and "<<<" not in cu, "kernel launches in hkt_attention_cuda.cu the emulation cannot read " \
        "(each must be kernel<real><<<grid, block, shmem, stream>>>(a))"
    kernels = "".join((csrc / "cuda" / name).read_text() for name in ("hkt_cuda_common.h", "hkt_cuda_f32_f64.h",
                                                              "hkt_cuda_tc.h"))
    assert "<<<" not in kernels, "kernel launches belong in hkt_attention_cuda.cu, where the emulation reads them"
    assert not re.search(r"cudaMalloc|cudaFree|cudaDeviceSynchronize|cudaStreamSynchronize", cu + kernels), \
        "the CUDA entry points must not allocate or synchronize (graph capture, stream order)"
    (d / "emu.cpp").write_text(cu)
    # the binding (csrc/binding/), two of its lines patched: q0_on_cuda says
    # yes, and the module is _Cemu
    binding = {c.name: c.read_text() for c in (csrc / "binding").iterdir() if c.suffix in (".c", ".h")}
    key = "return q0->device.device_type == kDLCUDA;"  # in q0_on_cuda
    assert binding["checks.c"].count(key) == 1, "csrc/binding/checks.c changed: update the emulation's patch"
    binding["checks.c"] = binding["checks.c"].replace(key, "return 1;")
    assert binding["module.c"].count('"hkt._C"') == 1, "csrc/binding/module.c changed: update the emulation's patch"
    binding["module.c"] = binding["module.c"].replace("PyInit__C", "PyInit__Cemu").replace('"hkt._C"', '"_Cemu"')
    (d / "binding").mkdir()
    for name, text in binding.items():
        (d / "binding" / name).write_text(text)
    binding_sources = sorted(name[:-2] for name in binding if name.endswith(".c"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    inc = sysconfig.get_paths()["include"]
    cpu_sources = sorted((csrc / "cpu").glob("*.c"))
    compiles = [
        ["g++", "-std=c++20", "-O1", "-fPIC", "-pthread", f"-I{d / 'inc'}", f"-I{csrc}", f"-I{csrc / 'cuda'}", "-DHKT_WITH_CUDA",
         "-DHKT_CUDA_EMULATION", "-c",
         str(d / "emu.cpp"), "-o", str(d / "emu.o")],
        *(["gcc", "-std=gnu11", "-O1", "-fPIC", "-fopenmp", "-Wno-psabi", f"-I{csrc}", f"-I{inc}", "-DHKT_WITH_CUDA",
           "-c", str(d / "binding" / f"{name}.c"), "-o", str(d / f"binding_{name}.o")] for name in binding_sources),
        # every CPU source the binding links against (the attention kernels, and
        # whatever else csrc/ holds beside the binding)
        *(["gcc", "-std=gnu11", "-O1", "-fPIC", "-fopenmp", "-Wno-psabi", f"-I{csrc}", "-c", str(c), "-o",
           str(d / f"{c.stem}.o")] for c in cpu_sources),
    ]
    # the objects side by side, as many at once as there are cores: one after
    # another they took half a minute
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda cmd: subprocess.run(cmd, check=True, capture_output=True), compiles))
    subprocess.run(["g++", "-shared", "-pthread", "-fopenmp", str(d / "emu.o"),
                    *(str(d / f"binding_{name}.o") for name in binding_sources),
                    *(str(d / f"{c.stem}.o") for c in cpu_sources), "-o", str(d / f"_Cemu{suffix}")],
                   check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("_Cemu", d / f"_Cemu{suffix}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_SHIM_CHECKS = r"""
#include <cuda_runtime.h>
#include <cstdio>
struct args { int *out; int mode; };
__global__ void sums(const args a) {
    /* mode 0: a warp's butterfly sum, then the block's through shared memory;
     * 1: lane 0 shuffles at another call; 2: lane 3 returns before the shuffle;
     * 3: the second warp returns before __syncthreads; 4: no __syncthreads
     * between writing shared memory and reading another thread's entry */
    __shared__ int part[64];
    const unsigned t = threadIdx.x, lane = t & 31;
    int x = (int)t;
    if (a.mode == 2 && lane == 3) return;
    if (a.mode == 3 && t >= 32) return;
    if (a.mode == 1 && lane == 0) x += __shfl_xor_sync(0xffffffffu, x, 1);
    else
        for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    part[t] = x;
    if (a.mode != 4) __syncthreads();
    a.out[t] = part[(t + 32) % 64];
}
int main() {
    for (int mode = 0; mode < 5; mode++) {
        int out[64] = {0};
        emu_launch(sums, 1, 64, 0, nullptr, args{out, mode});
        const cudaError_t e = cudaGetLastError();
        long total = 0;
        for (int t = 0; t < 64; t++) total += out[t];
        std::printf("%d %d %ld %s\n", mode, (int)e, total, e ? cudaGetErrorString(e) : "-");
    }
}
"""


def test_emulation_catches_what_a_gpu_would_not_forgive(tmp_path):
    """The emulation's own check (the shim the emulated tests compile the .cu
    with): a correct kernel gives the right sums with no error; lanes at
    different shuffles, a lane that returned before its warp's shuffle and
    threads that never reach the block's __syncthreads each make the launch's
    error, and the launch still finishes; a missing __syncthreads reads
    another thread's entry before it was written."""
    skip_without_emulation()
    (tmp_path / "cuda_runtime.h").write_text(_SHIM)
    (tmp_path / "checks.cpp").write_text(_SHIM_CHECKS)
    build = subprocess.run(["g++", "-std=c++20", "-O1", f"-I{tmp_path}", str(tmp_path / "checks.cpp"), "-o",
                            str(tmp_path / "checks")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(tmp_path / "checks")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got = {int(m): (int(e), int(total), why) for m, e, total, why in
           (line.split(" ", 3) for line in run.stdout.splitlines())}
    assert got[0] == (0, 64 * (496 + 1520) // 2, "-")  # each warp's sum: 0..31 and 32..63
    assert got[1][0] == 2 and "lanes of one warp met at different warp-wide operations" in got[1][2], got[1]
    assert got[2][0] == 2 and "returned" in got[2][2], got[2]
    assert got[3][0] == 2 and "never come" in got[3][2], got[3]
    assert got[4][0] == 0 and got[4][1] != got[0][1], got[4]


EMU_SIZES = [
    (1, 1, 1, 1, 3, 5, 1),
    (2, 3, 1, 7, 5, 3, 3),
    (1, 2, 7, 7, 4, 9, 2),
    (1, 1, 33, 65, 40, 33, 2),
    (1, 1, 20, 37, 6, 4, 5),
    (1, 1, 5, 0, 3, 2, 2),
    (2, 1, 97, 130, 13, 7, 3),
]


@pytest.mark.parametrize("size", EMU_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_emulated_cuda_kernels_match_cpu(emulated, size, dtype, mask, causal, dropout_p):
    B, H, T, S, D, Dv, L = size
    if T * S > 2000 and (mask in ("bool", "float") or dtype == torch.float32):
        pytest.skip("the big size runs a few combinations only: the emulation is slow")
    g = torch.Generator().manual_seed(T + 7 * S + L)
    noncontig = causal
    if noncontig:  # (B, n, H, d + 3) storage viewed as (B, H, n, d)
        rnd = lambda n, d: torch.randn(B, n, H, d + 3, generator=g, dtype=dtype)[..., :d].transpose(1, 2)
    else:
        rnd = lambda n, d: torch.randn(B, H, n, d, generator=g, dtype=dtype)
    q = [rnd(-(-T // 2**l), D) for l in range(L)]
    k = [rnd(-(-S // 2**l), D) for l in range(L)]
    v, dout = rnd(S, Dv), rnd(T, Dv)
    w = torch.randn(H, L, generator=g, dtype=dtype) if mask in (None, "bool4d") else torch.randn(L, generator=g,
                                                                                                  dtype=dtype)
    am = make_mask(mask, B, H, T, S, dtype) if S else None
    # a float mask (1, H, T, S) as it is, with its gradient (summed over B); others broadcast by strides
    dmask = mask == "float" and am is not None and takes_dmask(emulated)
    if am is not None and not dmask:
        am = am.expand(B, H, T, S)
    args = (q, k, v, w, dout, am, causal, 0.37 if L % 2 else None, dropout_p, 99 + T)
    want = run_binding(_C, *args, dmask=dmask)
    got = run_binding(emulated, *args, dmask=dmask)
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    assert_all_close(got, want, tol, tol)


@pytest.mark.parametrize("size", [(2, 4, 2, 9, 11, 3, 2), (1, 6, 1, 33, 20, 4, 3), (1, 4, 2, 40, 40, 5, 1)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_grouped_query(emulated, size, causal):
    """k and v with H_kv < H heads: the dk/dv kernel sums each kv head's query
    heads itself, so it must match the CPU kernels (and the reference)."""
    B, H, Hk, T, S, D, L = size
    q, k, v, w = sample_inputs(B, H, T, S, D, D, L, kv_heads=Hk, seed=T + S)
    dout = torch.randn(B, H, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    args = (q, k, v, w, dout, None, causal, None, 0.0, 0)
    got = run_binding(emulated, *args)
    assert_all_close(got, run_binding(_C, *args), 1e-9, 1e-9)
    assert got[2 + L].shape == (B, Hk, S, D)  # dk[0]: one gradient per kv head


@pytest.mark.parametrize("name", NON_FINITE)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_emulated_non_finite_values(emulated, name, dtype):
    # nan_k_one_visible hung before: the NaN lane alone went on into the warp's shuffles
    got, want = run_non_finite(emulated, name, dtype)
    assert_like_cpu(got, want, name, (len(got) - 4) // 2, 1e-9 if dtype == torch.float64 else 2e-4)


@pytest.mark.parametrize("shape", DMASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_emulated_dmask(emulated, shape, causal, dropout_p):
    if not takes_dmask(emulated):
        pytest.skip("the binding has no dmask yet")
    args = dmask_args(shape, torch.float64, causal, dropout_p)
    got = run_binding(emulated, *args, dmask=True)
    assert got[-1].shape == shape
    assert_all_close(got, run_binding(_C, *args, dmask=True), 1e-9, 1e-9)
    if dropout_p == 0:
        torch.testing.assert_close(got[-1], mask_grad_reference(*args), rtol=1e-9, atol=1e-9)
    # float32 too
    args32 = dmask_args(shape, torch.float32, causal, dropout_p)
    assert_all_close(run_binding(emulated, *args32, dmask=True), run_binding(_C, *args32, dmask=True), 2e-4, 2e-4)


# ---- the tensor-core bfloat16 kernels (tc_forward_kernel, tc_backward_kernel), emulated: the
# shim's mma follows the PTX ISA's fragment description, so this checks the
# kernel's indexing, levels, masks and softmax against that description; that
# the GPU's instruction matches it is for benchmarks/gpu_session.sh

TC_SIZES = [  # B, H, H_kv, T, S, D, Dv, L
    (1, 2, 2, 70, 45, 16, 8, 3),    # partial query and key tiles
    (2, 2, 1, 64, 64, 32, 24, 4),   # grouped kv heads; 4 levels
    (1, 1, 1, 5, 100, 16, 72, 1),   # one level; Dv past 64 (query fragments read per tile)
    (1, 1, 1, 200, 40, 80, 16, 2),  # 4 query blocks over 3 emulated ones (the task loop); D past 64
]


def _bf16_inputs(size, seed):
    B, H, Hk, T, S, D, Dv, L = size
    g = torch.Generator().manual_seed(seed)
    q = [torch.randn(B, H, -(-T // 2**l), D, generator=g).bfloat16() for l in range(L)]
    k = [torch.randn(B, Hk, -(-S // 2**l), D, generator=g).bfloat16() for l in range(L)]
    return q, k, torch.randn(B, Hk, S, Dv, generator=g).bfloat16(), torch.randn(H, L, generator=g)


def _forward_into(mod, q, k, v, w, am, causal, scale, dtype):
    B, H, T, _ = q[0].shape
    out = torch.full((B, H, T, v.shape[-1]), 7.0, dtype=dtype)
    lse = torch.full((B, H, T), 7.0, dtype=dtype)
    mod.forward(q, k, v, w, out, lse, am, causal, scale, 0.0, 0, 2)
    return out, lse


def _tc_and_float64(emulated, q, k, v, w, am, causal, scale=None):
    """the emulated bfloat16 forward, and the CPU's float64 one on the same (bfloat16) values"""
    got = _forward_into(emulated, q, k, v, w, am, causal, scale, torch.float32)
    d = lambda x: x.double()  # noqa: E731
    am64 = am.double() if am is not None and am.is_floating_point() else am
    want = _forward_into(_C, [d(x) for x in q], [d(x) for x in k], d(v), d(w), am64, causal, scale, torch.float64)
    return got, want


@pytest.mark.parametrize("size", TC_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_tensor_core_forward(emulated, size, mask, causal):
    B, H, Hk, T, S, D, Dv, L = size
    q, k, v, w = _bf16_inputs(size, T + S + L)
    if causal:  # rows 3 elements longer than D: the kernels copy them 2 bytes at a time, not 16
        q, k = [torch.cat([x, x[..., :3]], -1)[..., :D] for x in q], [torch.cat([x, x[..., :3]], -1)[..., :D] for x in k]
    am = make_mask(mask, B, H, T, S, torch.float32)
    am = am.expand(B, H, T, S) if am is not None else None
    (out, lse), (out64, lse64) = _tc_and_float64(emulated, q, k, v, w, am, causal, 0.3 if L % 2 else None)
    # P is rounded to bfloat16 before P.V (a relative 2^-9 per entry), so out is
    # within 2^-9 max|v| of float64; the scores and lse sum exact products in float32
    empty = torch.isinf(lse64)
    assert torch.equal(torch.isinf(lse), empty) and not torch.isnan(lse).any()
    torch.testing.assert_close(lse[~empty].double(), lse64[~empty], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.double(), out64, rtol=0, atol=2.0**-9 * float(v.abs().max()) + 1e-6)
    assert not out[empty.unsqueeze(-1).expand_as(out)].any(), "a row with no visible key must give zeros"


def test_emulated_tensor_core_forward_non_finite(emulated):
    B, H, T, S, D, L = 1, 2, 40, 40, 16, 2
    q, k, v, w = _bf16_inputs((B, H, H, T, S, D, 16, L), 5)
    am = torch.ones(B, H, T, S, dtype=torch.bool)
    am[:, :, 3] = False                 # row 3 sees nothing
    am[:, :, :, 7] = False              # nobody sees key 7 ...
    k[0][:, :, 7, 0] = float("nan")     # ... whose k is NaN
    q[0][:, 1, 5, 2] = float("nan")     # row 5 of head 1: NaN
    (out, lse), (out64, lse64) = _tc_and_float64(emulated, q, k, v, w, am, False)
    assert torch.isinf(lse[:, :, 3]).all() and (lse[:, :, 3] > 0).all() and not out[:, :, 3].any()
    assert torch.isnan(lse[:, 1, 5]).all() and torch.isnan(out[:, 1, 5]).all()
    fine = torch.ones(T, dtype=torch.bool)
    fine[[3, 5]] = False
    assert not torch.isnan(out[:, :, fine]).any()
    torch.testing.assert_close(out[:, :, fine].double(), out64[:, :, fine], rtol=0, atol=2e-2)


@pytest.mark.parametrize("change, name", [
    (dict(D=8), "q[0]"), (dict(Dv=12), "v"), (dict(L=5), "q"), (dict(dropout_p=0.1), "dropout_p")])
def test_emulated_tensor_core_limits_are_named(emulated, change, name):
    size = dict(D=16, Dv=16, L=2, dropout_p=0.0)
    size.update(change)
    q, k, v, w = _bf16_inputs((1, 1, 1, 8, 8, size["D"], size["Dv"], size["L"]), 0)
    out, lse = torch.empty(1, 1, 8, size["Dv"]), torch.empty(1, 1, 8)
    with pytest.raises(ValueError, match=re.escape(name + ":")):
        emulated.forward(q, k, v, w, out, lse, None, False, None, size["dropout_p"], 0, 2)
    assert _C.cuda_tc_refusal(size["D"], size["Dv"], size["L"], size["dropout_p"]).startswith(name + ":")


TC_BWD_SIZES = [  # B, H, H_kv, T, S, D, Dv, L: D and Dv multiples of 16 up to 64
    (1, 2, 2, 70, 45, 16, 16, 3),   # partial blocks and tiles
    (2, 2, 1, 64, 64, 32, 16, 4),   # grouped kv heads (dk, dv summed over 2 query heads); 4 levels
    (1, 1, 1, 5, 100, 16, 48, 1),   # one level; two key blocks
    (1, 1, 1, 130, 40, 64, 32, 2),  # three query blocks
]


def _tc_backward(mod, q, k, v, w, out, lse, dout, am, causal, scale):
    grads = [torch.full(tuple(x.shape), 5.0) for x in (*q, *k, v, w)]
    L = len(q)
    mod.backward(dout, q, k, v, w, out, lse, grads[:L], grads[L:2 * L], grads[2 * L], grads[2 * L + 1], am, causal,
                 scale, 0.0, 0, 2, scratch=scratch_for(q, lse))
    return grads


@pytest.mark.parametrize("size", TC_BWD_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_tensor_core_backward(emulated, size, mask, causal):
    """dq, dk, dv and dw of the bfloat16 backward against the float64 kernels on
    the same (bfloat16) values and the same bfloat16 out: P and dS are rounded
    to bfloat16 on their way into level 0's products, a relative 2^-9 each"""
    B, H, Hk, T, S, D, Dv, L = size
    q, k, v, w = _bf16_inputs(size, T + S + L + 1)
    if mask == "bool":
        w = w[0].contiguous()  # one w for every head: dw sums over them
    dout = torch.randn(B, H, T, Dv, generator=torch.Generator().manual_seed(2)).bfloat16()
    am = make_mask(mask, B, H, T, S, torch.float32)
    am = am.expand(B, H, T, S) if am is not None else None
    scale = 0.3 if L % 2 else None
    out, lse = _forward_into(emulated, q, k, v, w, am, causal, scale, torch.float32)
    got = _tc_backward(emulated, q, k, v, w, out.bfloat16(), lse, dout, am, causal, scale)
    # the float64 backward sees the same bfloat16 out (delta = rowsum(dO * out) uses it)
    d = lambda x: x.double()  # noqa: E731
    am64 = am.double() if am is not None and am.is_floating_point() else am
    q64, k64 = [d(x) for x in q], [d(x) for x in k]
    _, lse64 = _forward_into(_C, q64, k64, d(v), d(w), am64, causal, scale, torch.float64)
    want = [torch.empty(x.shape, dtype=torch.float64) for x in (*q, *k, v, w)]
    _C.backward(d(dout), q64, k64, d(v), d(w), d(out.bfloat16()), lse64, want[:L], want[L:2 * L], want[2 * L],
                want[2 * L + 1], am64, causal, scale, 0.0, 0, 2)
    names = [*(f"dq[{l}]" for l in range(L)), *(f"dk[{l}]" for l in range(L)), "dv", "dw"]
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert torch.isfinite(a).all(), name
        # level 0's products take P and dS rounded (measured: <= 3.6e-3 of the
        # largest entry); the coarse levels and dw sum in float32 (<= 3e-6)
        rel = 2.0**-7 if name in ("dq[0]", "dk[0]", "dv") else 1e-4
        err, size_ = float((a.double() - b).abs().max()), float(b.abs().max())
        assert err <= rel * size_ + 1e-6, (name, err, size_)


def test_emulated_tensor_core_backward_empty_rows(emulated):
    """a query that sees nothing and a key nobody sees get zero gradients"""
    B, H, T, S, D, L = 1, 2, 40, 40, 16, 2
    q, k, v, w = _bf16_inputs((B, H, H, T, S, D, 16, L), 6)
    am = torch.ones(B, H, T, S, dtype=torch.bool)
    am[:, :, 3] = False
    am[:, :, :, 7] = False
    dout = torch.randn(B, H, T, 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    out, lse = _forward_into(emulated, q, k, v, w, am, False, None, torch.float32)
    dq, dk, dv = (lambda g: (g[0], g[L], g[2 * L]))(_tc_backward(emulated, q, k, v, w, out.bfloat16(), lse, dout, am,
                                                                  False, None))
    assert all(torch.isfinite(x).all() for x in (dq, dk, dv))
    assert not dq[:, :, 3].any() and not dk[:, :, 7].any() and not dv[:, :, 7].any()
    assert dq[:, :, 2].abs().sum() > 0 and dk[:, :, 6].abs().sum() > 0


@pytest.mark.parametrize("T, S", [(5, 0), (0, 7)])
def test_emulated_tensor_core_no_keys_or_no_queries(emulated, T, S):
    q, k, v, w = _bf16_inputs((1, 2, 2, T, S, 16, 16, 2), 1)
    out, lse = _forward_into(emulated, q, k, v, w, None, False, None, torch.float32)
    assert not out.any() and (torch.isinf(lse) & (lse > 0)).all()
    grads = _tc_backward(emulated, q, k, v, w, out.bfloat16(), lse, torch.ones(1, 2, T, 16).bfloat16(), None, False,
                         None)
    assert not any(g.any() for g in grads)  # overwritten with zeros (they were 5.0)


def test_emulated_tensor_core_backward_repeats_bitwise(emulated):
    size = (1, 2, 1, 70, 45, 32, 16, 3)
    q, k, v, w = _bf16_inputs(size, 9)
    dout = torch.randn(1, 2, 70, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    out, lse = _forward_into(emulated, q, k, v, w, None, True, None, torch.float32)
    first = _tc_backward(emulated, q, k, v, w, out.bfloat16(), lse, dout, None, True, None)
    again = _tc_backward(emulated, q, k, v, w, out.bfloat16(), lse, dout, None, True, None)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("change, name", [(dict(D=80), "q[0]"), (dict(Dv=24), "v"), (dict(mask_grad=True), "dmask")])
def test_emulated_tensor_core_backward_limits_are_named(emulated, change, name):
    size = dict(D=16, Dv=16, mask_grad=False)
    size.update(change)
    q, k, v, w = _bf16_inputs((1, 1, 1, 8, 8, size["D"], size["Dv"], 2), 0)
    out, lse = _forward_into(emulated, q, k, v, w, None, False, None, torch.float32)
    grads = [torch.empty(x.shape) for x in (*q, *k, v, w)]
    am = torch.zeros(1, 1, 8, 8) if size["mask_grad"] else None
    kw = {"dmask": torch.empty(1, 1, 8, 8)} if size["mask_grad"] else {}
    with pytest.raises(ValueError, match=re.escape(name + ":")):
        emulated.backward(out.bfloat16(), q, k, v, w, out.bfloat16(), lse, grads[:2], grads[2:4], grads[4], grads[5],
                          am, False, None, 0.0, 0, 2, scratch=scratch_for(q, lse), **kw)
    assert _C.cuda_tc_refusal(size["D"], size["Dv"], 2, 0.0, True, size["mask_grad"]).startswith(name + ":")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit), not a GPU")
def test_kernels_compile_for_sm80_and_sm90_without_spills(tmp_path):
    """ptxas -v for the architectures setup.py builds by default: every kernel
    of the .cu, the tensor-core forward's four configurations and the three
    backward kernels included, keeps its values in registers (a spill to local
    memory costs a memory round trip inside the inner loops)."""
    csrc = Path(__file__).resolve().parents[2] / "csrc"

    def compile_for(arch):  # one nvcc per architecture, side by side: its report is then its own
        cmd = ["nvcc", "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-std=c++17", f"-I{csrc}",
               "-DHKT_WITH_CUDA", "-O3", "-Xptxas", "-v", "-c", str(csrc / "cuda" / "hkt_attention_cuda.cu"), "-o",
               str(tmp_path / f"k{arch}.o")]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_for, ("80", "90")))
    entries = []
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        # "Compiling entry function 'NAME' for 'sm_XX'" ... "N bytes spill stores, M bytes spill loads"
        entries += re.findall(r"Compiling entry function '(\w+)' for '(sm_\d+)'.*?(\d+) bytes spill stores, (\d+) "
                              r"bytes spill loads", res.stdout + res.stderr, re.S)
    names = {(n, a) for n, a, _, _ in entries}
    assert sum("tc_forward_kernel" in n for n, _ in names) == 8, sorted(names)  # 4 configurations x 2 archs
    assert sum("tc_backward_kernel" in n for n, _ in names) == 6, sorted(names)  # dq, dv, dk x 2 archs
    spilled = [(n, a, st, ld) for n, a, st, ld in entries if st != "0" or ld != "0"]
    assert not spilled, spilled


def test_tensor_core_limits_without_a_gpu():
    """_C.cuda_tc_refusal (every build) says which calls the tensor-core kernels take"""
    assert _C.cuda_tc_refusal(64, 64, 3, 0.0) is None
    assert _C.cuda_tc_refusal(128, 8, 4, 0.0) is None
    assert _C.cuda_tc_refusal(48, 128, 1, 0.0) is None
    for args in ((72, 64, 3, 0.0), (144, 64, 3, 0.0), (64, 136, 3, 0.0), (64, 60, 3, 0.0), (64, 64, 5, 0.0),
                 (64, 64, 3, 0.5)):
        assert _C.cuda_tc_refusal(*args) is not None, args


@pytest.mark.parametrize("args, name", [((0, 64, 3, 0.0), "D"), ((-16, 64, 3, 0.0), "D"), ((64, -8, 3, 0.0), "Dv"),
                                        ((64, 64, 0, 0.0), "L"), ((64, 64, -1, 0.0), "L"), ((64, 64, 99, 0.0), "L"),
                                        ((64, 64, 3, -0.5), "dropout_p"), ((64, 64, 3, float("nan")), "dropout_p")])
def test_tensor_core_limits_refuse_impossible_calls(args, name):
    """No call has these sizes: a ValueError naming the argument, not an answer about them (-16 is a
    multiple of 16 below 128, which read as a call the kernels take)"""
    with pytest.raises(ValueError, match=f"^{name}:"):
        _C.cuda_tc_refusal(*args)


# --------------------------------------------------------------------------- stream and scratch arguments, no GPU

def _small_call(dtype=torch.float64):
    q, k, v, w = sample_inputs(2, 3, 10, 9, 4, 5, 3, dtype=dtype)
    B, H, T = 2, 3, 10
    out, lse = torch.empty(B, H, T, 5, dtype=dtype), torch.empty(B, H, T, dtype=dtype)
    grads = ([torch.empty_like(x) for x in q], [torch.empty_like(x) for x in k], torch.empty_like(v),
             torch.empty_like(w))
    return q, k, v, w, out, lse, grads


def test_cuda_scratch_bytes_formula():
    for B, H, T, L, item in [(2, 3, 100, 3, 4), (1, 1, 1, 1, 8), (4, 16, 4096, 3, 4), (3, 2, 0, 2, 8),
                             (1, 2, 37, 5, 4)]:
        G = 2 ** (L - 1)
        assert _C.cuda_scratch_bytes(B, H, T, L, item) == (B * H * T + B * H * -(-T // G) * L) * item
    for bad in [(1, 1, 1, 0, 4), (1, 1, 1, 25, 4), (-1, 1, 1, 1, 4), (1, 1, 1, 1, 2)]:
        with pytest.raises(ValueError, match="cuda_scratch_bytes"):
            _C.cuda_scratch_bytes(*bad)
    with pytest.raises(OverflowError):
        _C.cuda_scratch_bytes(2**62, 2**62, 2**62, 1, 8)


def test_stream_argument():
    q, k, v, w, out, lse, _ = _small_call()
    want_out, want_lse = out.clone(), lse.clone()
    _C.forward(q, k, v, w, want_out, want_lse)
    for stream in (None, 0, 12345):  # ignored on the CPU
        _C.forward(q, k, v, w, out, lse, stream=stream)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(TypeError, match="stream: expected an int"):
        _C.forward(q, k, v, w, out, lse, stream="default")
    with pytest.raises(TypeError, match="stream"):
        _C.forward(q, k, v, w, out, lse, stream=True)
    with pytest.raises(ValueError, match="stream: expected a cudaStream_t"):
        _C.forward(q, k, v, w, out, lse, stream=-1)
    with pytest.raises(ValueError, match="stream"):
        _C.forward(q, k, v, w, out, lse, stream=2**64)


def test_scratch_argument():
    q, k, v, w, out, lse, (dq, dk, dv, dw) = _small_call()
    _C.forward(q, k, v, w, out, lse)
    dout = torch.randn_like(out)
    n = _C.cuda_scratch_bytes(2, 3, 10, 3, 8)
    _C.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, scratch=torch.zeros(n, dtype=torch.uint8))
    want = [x.clone() for x in (*dq, *dk, dv, dw)]
    _C.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, stream=0)  # the CPU needs no scratch
    assert all(torch.equal(a, b) for a, b in zip(want, (*dq, *dk, dv, dw)))
    with pytest.raises(ValueError, match=f"scratch: needs at least {n} bytes"):
        _C.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, scratch=torch.zeros(n - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scratch: must be aligned to 8 bytes"):
        _C.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, scratch=torch.zeros(n + 1, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="shares memory with the output scratch"):
        _C.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, scratch=dv)
    with pytest.raises(ValueError, match="scratch: output arrays must be C-contiguous"):
        _C.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw,
                    scratch=torch.zeros(2 * n, dtype=torch.uint8)[::2])


def test_emulated_backward_needs_scratch(emulated):
    q, k, v, w, out, lse, (dq, dk, dv, dw) = _small_call()
    emulated.forward(q, k, v, w, out, lse)
    with pytest.raises(ValueError, match="scratch: the CUDA backward needs a device array of at least"):
        emulated.backward(torch.randn_like(out), q, k, v, w, out, lse, dq, dk, dv, dw)


def test_emulated_kernels_refuse_softcap_by_name(emulated):
    # the CUDA kernels take no soft cap yet: named, never run without it
    q, k, v, w, out, lse, (dq, dk, dv, dw) = _small_call()
    with pytest.raises(NotImplementedError, match="^softcap: the CUDA kernels do not take softcap yet"):
        emulated.forward(q, k, v, w, out, lse, softcap=1.5)
    with pytest.raises(NotImplementedError, match="^softcap: the CUDA kernels do not take softcap yet"):
        emulated.backward(torch.randn_like(out), q, k, v, w, out, lse, dq, dk, dv, dw, softcap=1.5)
    emulated.forward(q, k, v, w, out, lse, softcap=0.0)  # 0.0: no cap, as without


def test_emulated_kernels_refuse_a_band_by_name(emulated):
    # the CUDA kernels take no sliding-window band: named, never run without it
    q, k, v, w, out, lse, (dq, dk, dv, dw) = _small_call()
    message = "^sliding_window: the CUDA kernels do not take a sliding-window band"
    with pytest.raises(NotImplementedError, match=message):
        emulated.forward(q, k, v, w, out, lse, sliding_window=3)
    with pytest.raises(NotImplementedError, match=message):
        emulated.backward(torch.randn_like(out), q, k, v, w, out, lse, dq, dk, dv, dw, sliding_window=3)
    emulated.forward(q, k, v, w, out, lse, sliding_window=None)  # None: no band, as without
