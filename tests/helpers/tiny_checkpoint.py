"""A tiny SD1.5 checkpoint under the file names the example workflows name, made with ComfyUI's own classes.

`SOURCE` is run by ComfyUI's interpreter in its checkout (`python -c SOURCE PATH...`): a one-level UNet with random
weights plus ComfyUI's CLIP-L and SD VAE with random weights (fp16, about 450 MB), saved the way
CheckpointLoaderSimple reads a checkpoint. Never a real model: the examples are run as shipped, not judged by
their pictures.
"""

SOURCE = r'''
import os, sys
paths = sys.argv[1:]
sys.argv = [sys.argv[0], "--cpu"]
sys.path.insert(0, os.getcwd())
import comfy.options
comfy.options.enable_args_parsing()
import torch
import safetensors.torch
import comfy.model_detection
import comfy.sd1_clip
import comfy.ldm.models.autoencoder as autoencoder

g = torch.Generator().manual_seed(1234)

def randomised(sd):
    return {k: (torch.randn(v.shape, generator=g) * 0.02).to(torch.float16).contiguous()
            if v.is_floating_point() else v.contiguous() for k, v in sd.items()}

unet_config = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
               "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
               "num_res_blocks": [1], "transformer_depth": [1], "channel_mult": [1], "transformer_depth_middle": 1,
               "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8,
               "transformer_depth_output": [1, 1], "use_temporal_attention": False, "use_temporal_resblock": False}
config = comfy.model_detection.model_config_from_unet_config(unet_config)
unet = config.get_model({}).diffusion_model
sd = {"model.diffusion_model." + k: v for k, v in randomised(unet.state_dict()).items()}
clip = comfy.sd1_clip.SD1ClipModel(device="cpu", dtype=torch.float16)
clip_sd = {k: v for k, v in clip.state_dict().items()}
clip_sd = randomised(clip_sd)
if "clip_l.transformer.text_model.embeddings.position_ids" in clip.state_dict():
    clip_sd["clip_l.transformer.text_model.embeddings.position_ids"] = clip.state_dict()[
        "clip_l.transformer.text_model.embeddings.position_ids"]
sd.update(config.process_clip_state_dict_for_saving(clip_sd))
ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
            "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
vae = autoencoder.AutoencoderKL(ddconfig=ddconfig, embed_dim=4)
sd.update(config.process_vae_state_dict_for_saving(randomised(vae.state_dict())))
for path in paths:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    safetensors.torch.save_file(sd, path)
print("ok", len(sd))
'''
