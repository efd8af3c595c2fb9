"""The package's benchmark plus ComfyUI's attention as reference paths.

    python bench/bench_comfyui.py [any `python -m dispatcher bench` option] [--comfyui PATH] [--no-comfy]

Adds, per shape, ComfyUI's default attention path ("comfy default", a rewrite of `attention_pytorch`) and,
with `--comfyui PATH` or `COMFYUI_PATH`, ComfyUI's own `attention_pytorch` imported from that checkout
("comfyui"), each timed against the pack's path on the same (B, L, H·D) inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from comfyui_attention import comfy_attention_pytorch, load_comfyui_attention  # noqa: E402

from dispatcher.tools import bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/bench_comfyui.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"), metavar="PATH",
                        help="a ComfyUI checkout: also time its own attention_pytorch (default: $COMFYUI_PATH)")
    parser.add_argument("--no-comfy", action="store_true", help="no ComfyUI reference paths (the plain package bench)")
    args = parser.parse_args(argv)
    references = {}
    if not args.no_comfy:
        references["comfy default"] = comfy_attention_pytorch
        own = load_comfyui_attention(args.comfyui, lambda text: print(text, file=sys.stderr))
        if own is not None:  # ComfyUI's own function, with its per-call SDPA priority block on CUDA
            references["comfyui"] = own
    return bench.main(args, references=references)


if __name__ == "__main__":
    sys.exit(main())
