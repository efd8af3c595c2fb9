"""Source of a test-only V1 node pack, written into the temp ComfyUI by the session fixture.

Text encoders have fixed, large configs, so conditioning comes from a seeded random node, and the
CLIP test uses a 2-layer CLIP-L built with ComfyUI's own classes.
"""

SOURCE = r'''
import torch
import comfy.sd
import comfy.supported_models


class TestRandomConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31}),
                             "length": ("INT", {"default": 8, "min": 1, "max": 512}),
                             "dim": ("INT", {"default": 4096, "min": 1, "max": 8192}),
                             "pooled_dim": ("INT", {"default": 768, "min": 1, "max": 8192})}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, length, dim, pooled_dim):
        g = torch.Generator().manual_seed(seed)
        cond = torch.randn(1, length, dim, generator=g)
        return ([[cond, {"pooled_output": torch.randn(1, pooled_dim, generator=g)}]],)


class TestTinyClip:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed):
        target = comfy.supported_models.SD15({}).clip_target()
        clip = comfy.sd.CLIP(target, model_options={"clip_l_model_config": {
            "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
            "projection_dim": 64}})
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in clip.cond_stage_model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        return (clip,)


class TestConditioningStats:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",)}}
    RETURN_TYPES = ()
    FUNCTION = "stats"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    def stats(self, conditioning):
        t = conditioning[0][0]
        return {"ui": {"text": [repr([float(t.double().mean()), float(t.double().abs().sum())])]}}


NODE_CLASS_MAPPINGS = {"TestRandomConditioning": TestRandomConditioning, "TestTinyClip": TestTinyClip,
                       "TestConditioningStats": TestConditioningStats}
'''

MAKE_MODELS = r'''
"""Run by ComfyUI's interpreter in its checkout: tiny random-weight models with ComfyUI's own classes."""
import os, sys
out_dir = sys.argv[1]
sys.argv = [sys.argv[0], "--cpu"]
sys.path.insert(0, os.getcwd())
import comfy.options
comfy.options.enable_args_parsing()
import torch
import safetensors.torch
import comfy.ops
import comfy.model_detection
import comfy.ldm.wan.model as wan

g = torch.Generator().manual_seed(1234)

def randomised(sd):
    return {k: (torch.randn(v.shape, generator=g) * 0.02).to(torch.float32).contiguous() for k, v in sd.items()}

w = wan.WanModel(model_type="t2v", dim=256, ffn_dim=512, num_heads=2, num_layers=2, text_dim=4096, in_dim=16,
                 out_dim=16, operations=comfy.ops.disable_weight_init)
safetensors.torch.save_file(randomised(w.state_dict()), os.path.join(out_dir, "tiny_wan21.safetensors"))

sd15 = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
        "adm_in_channels": None, "in_channels": 4, "model_channels": 320, "num_res_blocks": [1],
        "transformer_depth": [1], "channel_mult": [1], "transformer_depth_middle": 1,
        "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8, "transformer_depth_output": [1, 1],
        "use_temporal_attention": False, "use_temporal_resblock": False}
unet = comfy.model_detection.model_config_from_unet_config(sd15).get_model({}).diffusion_model
safetensors.torch.save_file(randomised(unet.state_dict()), os.path.join(out_dir, "tiny_sd15.safetensors"))
print("ok")
'''
