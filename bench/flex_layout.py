"""Compiled flex_attention on ComfyUI's strided (B, H, L, D) views against contiguous copies (copy included).

    python bench/flex_layout.py   (a CUDA GPU; each variant compiled statically on its own)

Measured on the H200 (bench/results/README.md): why the flex backend keeps ComfyUI's layout.
"""
import torch
import triton.testing
from torch.nn.attention.flex_attention import flex_attention

SHAPES = {"sdxl": (2, 10, 4096, 64), "flux": (1, 24, 4608, 128), "qwen": (1, 24, 4352, 128),
          "wan-1.3b": (1, 12, 32760, 128)}


def fresh(tag):  # its own code object: its own compile cache, a static compile per variant
    def f(q, k, v):
        return flex_attention(q, k, v)
    f.__code__ = f.__code__.replace(co_name=f"flex_{tag}")
    return torch.compile(f)


for name, (b, h, l, d) in SHAPES.items():
    q3, k3, v3 = (torch.randn(b, l, h * d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qs, ks, vs = (t.view(b, l, h, d).transpose(1, 2) for t in (q3, k3, v3))
    fs, fc = fresh(name.replace("-", "_").replace(".", "_") + "_s"), fresh(name.replace("-", "_").replace(".", "_") + "_c")
    strided = lambda: fs(qs, ks, vs)
    contig = lambda: fc(qs.contiguous(), ks.contiguous(), vs.contiguous())
    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
    for fn in (strided, contig):
        assert (fn() - ref).abs().max().item() < 5e-2
    ts, tc = triton.testing.do_bench(strided, rep=200), triton.testing.do_bench(contig, rep=200)
    ts2 = triton.testing.do_bench(strided, rep=200)
    print(f"{name:9} strided {ts:.3f}/{ts2:.3f} ms, contiguous copies + kernel {tc:.3f} ms, copy/strided {tc / ts:.3f}",
          flush=True)
