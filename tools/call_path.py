"""The Python call path of hkt.hkt_attention, counted: which of hkt's functions
an eager call runs on its way to the kernel, and how often it goes back to a
file it had left.

A "stay" is one entry into a function of the hkt package (a Python frame whose
file is under the tree's hkt/; Python 3.11 gives a comprehension a frame of its
own, counted apart); a "return" is a stay in a file that the path
had already left for another one (the reader going back up).  Frames of torch
and of the standard library are not counted, but a stay they lead to is.
Printed per call: with gradients (the forward, then its backward) and without;
float32, B=1, H=2, T=16, D=16, L=2, causal.

    python tools/call_path.py [TREE]     (TREE: a source tree with hkt/ built in place; default this one)

tests/packaging/test_call_path.py holds every path to at most 12 stays and 4
returns (issue 47, "One way through").
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# run in a child whose sys.path starts with the tree under test
CHILD = r"""
import json, os, sys
tree = sys.argv[1]
sys.path.insert(0, tree)
import torch, hkt
assert hkt.__file__.startswith(tree), hkt.__file__
pkg = os.path.join(tree, "hkt") + os.sep

def walk(fn):
    stays, kernel = [], []
    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(pkg):
            stays.append((os.path.relpath(frame.f_code.co_filename, tree), frame.f_code.co_name))
        elif event == "c_call" and getattr(arg, "__module__", None) == "hkt._C" and not kernel:
            kernel.append(len(stays))
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    left, returns, prev = set(), 0, None
    for path, _ in stays:
        if path != prev:
            if path in left:
                returns += 1
            if prev is not None:
                left.add(prev)
            prev = path
    comprehensions = sum(n in ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>") for _, n in stays)
    return {"stays": len(stays), "comprehensions": comprehensions, "returns": returns, "stays before the kernel": kernel[0] if kernel else None,
            "reference": any(p.endswith("reference.py") for p, _ in stays),
            "path": [f"{p}:{n}" for p, n in stays]}

def inputs(grad):
    g = torch.Generator().manual_seed(0)
    q = [torch.randn(1, 2, 16 >> l, 16, generator=g).requires_grad_(grad) for l in range(2)]
    k = [torch.randn(1, 2, 16 >> l, 16, generator=g).requires_grad_(grad) for l in range(2)]
    v = torch.randn(1, 2, 16, 16, generator=g).requires_grad_(grad)
    w = torch.ones(2).requires_grad_(grad)
    return q, k, v, w

def call(args):
    return hkt.hkt_attention(*args, is_causal=True)

for grad in (True, False):  # once unmeasured: imports and first-call caches out of the way
    out = call(inputs(grad))
    if grad:
        out.sum().backward()
res = {}
args = inputs(True)
box = []
res["forward, with gradients"] = walk(lambda: box.append(call(args)))
dout = torch.ones_like(box[0])
res["backward"] = walk(lambda: box[0].backward(dout))
args = inputs(False)
res["forward, no gradients"] = walk(lambda: call(args))
print(json.dumps(res))
"""


def measure(tree=ROOT):
    """{path name: {"stays", "comprehensions", "returns", "stays before the kernel",
    "reference", "path"}} for the three paths, measured in a child on tree."""
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(tree)], capture_output=True, text=True,
                         check=True, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    res = measure(sys.argv[1] if len(sys.argv) > 1 else ROOT)
    for name, r in res.items():
        print(f"{name}: {r['stays']} stays ({r['comprehensions']} of them comprehensions, which Python 3.12 "
              f"inlines), {r['returns']} returns to a file already left, kernel after "
              f"{r['stays before the kernel']} stays, through reference.py: {r['reference']}")
        for step in r["path"]:
            print(f"    {step}")


if __name__ == "__main__":
    main()
