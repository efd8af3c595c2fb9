"""What the model's identity costs (nodes/model_identity.py: SAMPLES elements of every parameter and buffer), per
Set Attention Backend run, on a real UNet's tensors, beside reading every weight once (a full hash).

    python bench/model_identity_cost.py [--model sd15|sdxl] [--device cpu|cuda] [--dtype bf16] [--repeat 5]
                                        [--json PATH]

The UNet (diffusers' UNet2DConditionModel with SD1.5's or SDXL's shapes) is made on the meta device and given
uninitialised memory on --device: its values do not matter for the time, its tensors' count and sizes do.
Reports the median of --repeat runs of `model_key` (after one warm run) and of a SHA-1 over every weight's bytes
(copied to the CPU), the tensor count and the bytes `model_key` reads.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import statistics
import sys
import time
import types

import torch

from comfy_model_step import load_pack  # bench/ is on sys.path when a script of it runs
from output import emit

CONFIGS = {
    "sd15": dict(cross_attention_dim=768),
    "sdxl": dict(block_out_channels=(320, 640, 1280), down_block_types=(
        "DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"), up_block_types=(
        "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20), cross_attention_dim=2048, addition_embed_type="text_time",
        addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816, use_linear_projection=True),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def unet(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel
    with torch.device("meta"):
        model = UNet2DConditionModel(**CONFIGS[name])
    return model.to(dtype).to_empty(device=device)


def timed(fn, repeat: int, device: str) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def full_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="sd15")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-full-hash", action="store_true", help="skip the full hash (large models on a CPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_pack()
    identity = importlib.import_module("attention_dispatch_pack.nodes.model_identity")
    model = unet(args.model, args.device, DTYPES[args.dtype])
    patcher = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=model), patches={})
    tensors = identity._named_tensors(model)
    read = sum(min(identity.SAMPLES, t.numel()) * t.element_size() for _, t in tensors)
    result = {"model": args.model, "device": str(torch.device(args.device)), "dtype": args.dtype,
              "torch": torch.__version__, "tensors": len(tensors),
              "parameters": sum(p.numel() for p in model.parameters()),
              "weight_bytes": sum(t.numel() * t.element_size() for _, t in tensors),
              "bytes_read": read, "model_key_ms": round(timed(lambda: identity.model_key(patcher), args.repeat,
                                                                args.device), 2)}
    if not args.no_full_hash:
        result["full_hash_ms"] = round(timed(lambda: full_hash(model), max(1, args.repeat // 2), args.device), 1)
    emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
