"""Source of a test-only V1 node pack, written into the temp ComfyUI by the session fixture.

Text encoders have fixed, large configs, so conditioning comes from a seeded random node, and the
CLIP test uses a 2-layer CLIP-L built with ComfyUI's own classes.

Models the loader cannot detect at a tiny size are built in-process with ComfyUI's own classes:
- TestTinyFlux: ComfyUI's Flux (FluxSchnell config) at hidden 64; `UNETLoader` detection hardcodes hidden 3072
  (535M parameters). Its attention reaches the override as (B, H, L, D) with skip_reshape=True and `mask=`.
- TestKwargsDiT: a one-block DiT whose calls carry the newer contract's keyword arguments (`scale=`,
  `enable_gqa=True` with fewer key/value heads, `low_precision_attention=False`, `skip_output_reshape=True`).
  ComfyUI 0.3.64's wrapper hands every keyword argument to the override unchanged, but its own backends drop
  `scale`/`enable_gqa`, so the reference is the same model with exact SDPA (`reference=True`).
- TestOtherOverride: another pack's override on the same key (it runs self-attention itself and passes the rest to
  the override it found), or a stand-in for newer ComfyUI's Model Attention Backend (one backend, passes nothing on).
- TestAttentionMask: adds Flux's `attention_mask` conditioning (an additive (B, L, L) bias over text+image
  tokens), which reaches the attention calls as `mask=`.
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


class TestNaNConditioning:
    """A conditioning with one NaN: the cross-attention keys and values of a model sampled with it hold NaN."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",)}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "poison"
    CATEGORY = "testing"

    def poison(self, conditioning):
        cond = conditioning[0][0].clone()
        cond[0, 0, 0] = float("nan")
        return ([[cond, dict(conditioning[0][1])]],)


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


def _randomise(module, seed, std=0.02):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _patcher(model):
    import comfy.model_management as mm
    import comfy.model_patcher
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())


TINY_FLUX = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 64,
             "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
             "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": False}


class TestTinyFlux:
    """ComfyUI's own Flux model (FluxSchnell config: flow, no guidance) at hidden 64, 2 heads of 32, random weights."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed):
        config = comfy.supported_models.FluxSchnell(TINY_FLUX)
        config.set_inference_dtype(torch.float32, None)
        model = config.get_model({})
        _randomise(model.diffusion_model, seed, std=0.05)
        return (_patcher(model),)


class TestAttentionMask:
    """Flux's `attention_mask` conditioning: an additive bias (B, T+I, T+I) over text (T) and image (I) tokens
    that hides the last `masked` text tokens from every query (-inf), as StyleModelApply's attn_bias does."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",),
                             "image_tokens_h": ("INT", {"default": 4, "min": 1, "max": 64}),
                             "image_tokens_w": ("INT", {"default": 4, "min": 1, "max": 64}),
                             "masked": ("INT", {"default": 3, "min": 0, "max": 64})}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "apply"
    CATEGORY = "testing"

    def apply(self, conditioning, image_tokens_h, image_tokens_w, masked):
        out = []
        for txt, keys in conditioning:
            n = txt.shape[1] + image_tokens_h * image_tokens_w
            mask = torch.zeros((txt.shape[0], n, n))
            mask[:, :, txt.shape[1] - masked:txt.shape[1]] = float("-inf")
            keys = dict(keys, attention_mask=mask, attention_mask_img_shape=(image_tokens_h, image_tokens_w))
            out.append([txt, keys])
        return (out,)


class KwargsDiT(torch.nn.Module):
    """One DiT block whose attention calls carry the newer contract's keyword arguments.

    self-attention: (B, H, L, D) q with (B, H/2, L, D) k/v, `scale=`, `enable_gqa=True`, `heads=` as a keyword;
    cross-attention to the conditioning: `low_precision_attention=False`, `skip_output_reshape=True` (the output
    stays (B, H, Lq, D)). With `reference=True` both run torch SDPA directly (exact, no ComfyUI attention).
    """

    def __init__(self, in_channels=4, hidden=64, heads=4, kv_heads=2, context_dim=64, scale=1.0, reference=False,
                 device=None, dtype=None, operations=None, **kwargs):
        super().__init__()
        ops = operations
        self.dtype = dtype if dtype is not None else torch.float32
        self.heads, self.kv_heads, self.dim, self.scale, self.reference = heads, kv_heads, hidden // heads, scale, reference
        self.inp = ops.Linear(in_channels, hidden, device=device, dtype=dtype)
        self.time = ops.Linear(64, hidden, device=device, dtype=dtype)
        self.q = ops.Linear(hidden, hidden, device=device, dtype=dtype)
        self.kv = ops.Linear(hidden, 2 * kv_heads * self.dim, device=device, dtype=dtype)
        self.cq = ops.Linear(hidden, hidden, device=device, dtype=dtype)
        self.ckv = ops.Linear(context_dim, 2 * hidden, device=device, dtype=dtype)
        self.out = ops.Linear(hidden, in_channels, device=device, dtype=dtype)

    def attention(self, q, k, v, transformer_options, **kwargs):
        import comfy.ldm.modules.attention as attention
        if self.reference:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=kwargs.get("scale"),
                                                                   enable_gqa=kwargs.get("enable_gqa", False))
            return out if kwargs.get("skip_output_reshape") else out.transpose(1, 2).flatten(2)
        return attention.optimized_attention(q, k, v, heads=self.heads, skip_reshape=True,
                                             transformer_options=transformer_options, **kwargs)

    def forward(self, x, timesteps, context=None, transformer_options={}, **kwargs):
        import comfy.ldm.modules.diffusionmodules.util as util
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)
        hid = self.inp(tokens) + self.time(util.timestep_embedding(timesteps, 64).to(x.dtype))[:, None]
        heads = lambda t, n: t.unflatten(-1, (n, self.dim)).transpose(1, 2)  # noqa: E731
        q = heads(self.q(hid), self.heads)
        k, v = (heads(t, self.kv_heads) for t in self.kv(hid).chunk(2, dim=-1))
        hid = hid + self.attention(q, k, v, transformer_options, scale=self.scale, enable_gqa=True)
        q = heads(self.cq(hid), self.heads)
        k, v = (heads(t, self.heads) for t in self.ckv(context).chunk(2, dim=-1))
        out = self.attention(q, k, v, transformer_options, low_precision_attention=False, skip_output_reshape=True)
        hid = hid + out.transpose(1, 2).flatten(2)
        return self.out(hid).transpose(1, 2).reshape(b, c, h, w)


class TestKwargsDiT:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31}),
                             "reference": ("BOOLEAN", {"default": False})}}
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, reference):
        import comfy.latent_formats
        import comfy.model_base
        import comfy.supported_models_base

        class Config(comfy.supported_models_base.BASE):
            unet_config = {}
            unet_extra_config = {}
            latent_format = comfy.latent_formats.SD15
            sampling_settings = {"multiplier": 1.0, "shift": 1.0}
            supported_inference_dtypes = [torch.float32]
            memory_usage_factor = 1.0

        config = Config({"reference": reference})
        config.set_inference_dtype(torch.float32, None)
        model = comfy.model_base.BaseModel(config, model_type=comfy.model_base.ModelType.FLOW, unet_model=KwargsDiT)
        _randomise(model.diffusion_model, seed, std=0.25)
        return (_patcher(model),)


def other_pack_override(previous):
    """Another pack's override on the same key: it runs self-attention itself and passes cross-attention on to the
    override it found (or to ComfyUI's func)."""
    def override(func, q, k, v, *args, **kwargs):
        if q.shape == k.shape:
            return func(q, k, v, *args, **kwargs)
        return func(q, k, v, *args, **kwargs) if previous is None else previous(func, q, k, v, *args, **kwargs)
    return override


def core_backend_override(optimized_attention):
    """A stand-in for ComfyUI 0.38's Model Attention Backend (ModelPatcher.set_model_optimized_attention, which 0.3.64
    lacks), with the identity the real one has: one backend for every call, never passing a call on."""
    def optimized_attention_override(_, *args, **kwargs):
        return optimized_attention(*args, **kwargs)
    optimized_attention_override.__module__ = "comfy.model_patcher"
    optimized_attention_override.__qualname__ = \
        "ModelPatcher.set_model_optimized_attention.<locals>.optimized_attention_override"
    return optimized_attention_override


class TestOtherOverride:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "kind": (["other pack", "core backend"],)}}
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing"

    def patch(self, model, kind):
        import comfy.ldm.modules.attention as attention
        m = model.clone()
        to = m.model_options.setdefault("transformer_options", {})
        previous = to.get("optimized_attention_override")
        to["optimized_attention_override"] = (other_pack_override(previous) if kind == "other pack" else
                                              core_backend_override(attention.get_attention_function("pytorch")))
        return (m,)


NODE_CLASS_MAPPINGS = {"TestRandomConditioning": TestRandomConditioning, "TestTinyClip": TestTinyClip,
                       "TestConditioningStats": TestConditioningStats, "TestTinyFlux": TestTinyFlux,
                       "TestAttentionMask": TestAttentionMask, "TestKwargsDiT": TestKwargsDiT,
                       "TestOtherOverride": TestOtherOverride, "TestNaNConditioning": TestNaNConditioning}
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
