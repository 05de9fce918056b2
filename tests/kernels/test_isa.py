"""Every instruction-set build of the CPU kernels (hkt_cpu.h: AVX-512, AVX2 and
the portable one, each with vectors as wide as its registers) against the
float64 reference: forward, backward and decoding, float32 and float64,
bitwise the same for any thread count.  The build is chosen once per process,
so each runs in a subprocess with HKT_CPU_KERNELS naming it; a set this CPU
lacks falls back to the widest it has, and is skipped."""
import os
import subprocess
import sys

import pytest

import hkt
from research.timing import machine_info
from helpers import assert_build_matches, run_on_kernels


SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import hkt
from hkt.reference import hkt_attention_reference as reference
from helpers import sample_inputs, with_threads

res = {"kernels": hkt._C.cpu_kernels(), "errors": {}, "same_bits": True}
for dtype in (torch.float32, torch.float64):
    # awkward sizes: tails of every tile width, coarse levels, grouped kv heads
    for (B, H, T, S, D, Dv, L, kv, causal) in [(2, 4, 97, 130, 13, 7, 3, 2, False), (1, 2, 200, 200, 64, 64, 3, 1, True),
                                                 (1, 3, 33, 33, 5, 3, 4, None, True)]:
        q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, dtype=dtype, requires_grad=True, kv_heads=kv)
        g = torch.randn(B, H, T, Dv, generator=torch.Generator().manual_seed(1), dtype=dtype)
        leaves = [*q, *k, v, w]

        def run():
            out = hkt.hkt_attention(q, k, v, w, is_causal=causal)
            return [out, *torch.autograd.grad(out, leaves, g)]

        got = run()
        leaves64 = [x.detach().double().requires_grad_() for x in leaves]
        out64 = reference(leaves64[:L], leaves64[L:2 * L], leaves64[2 * L], leaves64[2 * L + 1], is_causal=causal)
        want = [out64, *torch.autograd.grad(out64, leaves64, g.double())]
        err = max(((a.double() - b).abs().max() / (1 + b.abs().max())).item() for a, b in zip(got, want))
        res["errors"][f"{dtype} T={T} L={L}"] = err
        for n in (1, 3):
            res["same_bits"] &= all(torch.equal(a, b) for a, b in zip(with_threads(n, run), got))
    # decoding: one call over a cache against the causal forward's last row
    q, k, v, w = sample_inputs(1, 4, 40, 40, 16, 8, 3, dtype=dtype)
    full = hkt.hkt_attention(q, k, v, w, is_causal=True)
    with torch.no_grad():
        last = hkt.hkt_attention_with_kvcache([x[:, :, (39 >> l):(39 >> l) + 1] for l, x in enumerate(q)], k, v, w, 39)
    res["errors"][f"{dtype} decode"] = (last[:, :, 0] - full[:, :, 39]).abs().max().item()
print(json.dumps(res))
"""


def run_with(kernels):
    return run_on_kernels(SCRIPT, kernels)


@pytest.mark.parametrize("kernels", ["avx512f", "avx2", "default"])
def test_every_build_matches_the_reference(kernels):
    assert_build_matches(run_with(kernels), kernels)


def test_unknown_choice_falls_back_to_the_widest():
    assert run_with("no-such-set")["kernels"] == hkt._C.cpu_kernels()


@pytest.mark.parametrize("setting, warned", [
    ("HKT_CPU_KERNELS=AVX2", "HKT_CPU_KERNELS=AVX2 is not one of default, avx2, avx512f; running the "),
    ("HKT_CPU_KERNELS=avx-2", "HKT_CPU_KERNELS=avx-2 is not one of"),
    ("HKT_BF16=Upcast", "HKT_BF16=Upcast is not one of native, avx512bf16, upcast; bfloat16 runs "),
    # a byte that is no UTF-8, and a 40-byte cut through a character: the
    # message is a Python str (both failed the import with UnicodeDecodeError)
    ("HKT_CPU_KERNELS=\udcff", "HKT_CPU_KERNELS=? is not one of"),
    ("HKT_BF16=a" + "\u00e9" * 30, "HKT_BF16=a" + "?" * 39 + " is not one of"),
    ("HKT_CPU_KERNELS=default", None), ("HKT_CPU_KERNELS=", None), ("HKT_BF16=upcast", None),
    ("HKT_BF16=native", None)])
def test_a_misspelt_setting_is_warned_of(setting, warned):
    """A value neither variable knows ran the default choice in silence: an
    'AVX2' benchmark ran the AVX-512 kernels unnoticed.  Now the import warns
    (RuntimeWarning, as torch warns of an ATEN_CPU_CAPABILITY it does not know)
    and says what runs instead; a known value warns of nothing, unless the CPU
    cannot run it."""
    name, value = setting.split("=")
    env = {k: v for k, v in os.environ.items() if k not in ("HKT_CPU_KERNELS", "HKT_BF16")}
    env[name] = value
    out = subprocess.run([sys.executable, "-c", "import hkt"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    if warned is None:
        assert "RuntimeWarning" not in out.stderr, out.stderr
    else:
        assert f"RuntimeWarning: {warned}" in out.stderr, out.stderr


def bf16_choice(setting):
    env = {k: v for k, v in os.environ.items() if k != "HKT_BF16"}
    if setting is not None:
        env["HKT_BF16"] = setting
    code = ("import hkt; from hkt._core import kernels as _kernels; "
            "print(hkt._C.cpu_bf16_preferred(), _kernels.native_bf16, hkt._C.cpu_bf16_amx())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_bf16_path_follows_the_core_and_the_environment():
    """bfloat16 takes the native kernels on AMD cores, which issue vdpbf16ps at
    the FMA's rate, and on Intel's where they have AMX, whose tiles take the
    products; Intel's without AMX issue vdpbf16ps at half rate, and there it is
    upcast.  HKT_BF16 overrides either way (avx512bf16: native, products without
    AMX), but never turns on kernels the CPU lacks."""
    has = hkt._C.cpu_has_bf16()
    preferred, python_side, amx = bf16_choice(None)
    assert preferred == python_side, "the Python layer must follow the C choice"
    assert amx == "False" or has, "AMX products are of the native kernels"
    flags = set(machine_info().get("flags", []))  # /proc/cpuinfo's, where there is one
    if flags:
        assert amx == str(has and {"amx_bf16", "amx_tile"} <= flags), (amx, sorted(flags))
    vendor = machine_info().get("vendor")  # /proc/cpuinfo's vendor_id, where there is one
    if vendor in ("GenuineIntel", "AuthenticAMD"):
        assert preferred == str(has and (vendor == "AuthenticAMD" or amx == "True"))
    assert bf16_choice("native") == [str(has)] * 2 + [amx]
    assert bf16_choice("avx512bf16") == [str(has)] * 2 + ["False"]
    assert bf16_choice("upcast") == ["False"] * 2 + [amx]


def test_hkt_bf16_is_read_once():
    """HKT_BF16 is read at the first call that asks, as HKT_CPU_KERNELS is: a
    change to the environment later in the process changes no choice (a call
    reads no environment).  Each value is set in a fresh child, the opposite one
    after the first call."""
    code = ("import os, hkt\n"
            "first = (hkt._C.cpu_bf16_preferred(), hkt._C.cpu_bf16_amx())\n"
            "os.environ['HKT_BF16'] = 'native' if os.environ['HKT_BF16'] == 'upcast' else 'upcast'\n"
            "print(first == (hkt._C.cpu_bf16_preferred(), hkt._C.cpu_bf16_amx()), first[0])\n")
    seen = []
    for setting in ("upcast", "native"):
        env = {**os.environ, "HKT_BF16": setting}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        same, preferred = out.stdout.split()
        assert same == "True", setting
        seen.append(preferred)
    # the two settings did take: upcast never prefers the native kernels, native does where they exist
    assert seen == ["False", str(hkt._C.cpu_has_bf16())]
