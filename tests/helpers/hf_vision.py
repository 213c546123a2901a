"""Sweep: Hugging Face vision models and diffusers models no test names, each from a tiny config (no download).

Run: ``PYTHONPATH=tests python -m helpers.hf_vision [names...] [--trace]``; one line per model (see helpers/sweep.py).
"""

from __future__ import annotations

from typing import Any

import torch

from helpers import sweep as harness

B = 2


def px(size: int = 16, channels: int = 3) -> torch.Tensor:
    return torch.randn(B, channels, size, size)


def vit_kw(**extra: Any) -> dict[str, Any]:
    return dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, **extra)


# ---- transformers -----------------------------------------------------------------------------------------------

def deit() -> harness.Built:
    import transformers as t
    cfg = t.DeiTConfig(image_size=16, patch_size=8, num_labels=3, **vit_kw())
    return t.DeiTForImageClassification(cfg), {"pixel_values": px()}


def beit() -> harness.Built:
    import transformers as t
    cfg = t.BeitConfig(image_size=16, patch_size=8, use_relative_position_bias=True, use_mean_pooling=True,
                       **vit_kw())
    return t.BeitModel(cfg), {"pixel_values": px()}


def swin() -> harness.Built:
    import transformers as t
    cfg = t.SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4)
    return t.SwinModel(cfg), {"pixel_values": px(32)}


def swinv2() -> harness.Built:
    import transformers as t
    cfg = t.Swinv2Config(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4)
    return t.Swinv2Model(cfg), {"pixel_values": px(32)}


def convnext() -> harness.Built:
    import transformers as t
    cfg = t.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, drop_path_rate=0.1)
    return t.ConvNextModel(cfg), {"pixel_values": px(32)}


def convnextv2() -> harness.Built:
    import transformers as t
    cfg = t.ConvNextV2Config(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)
    return t.ConvNextV2Model(cfg), {"pixel_values": px(32)}


def resnet() -> harness.Built:
    import transformers as t
    cfg = t.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck",
                         num_labels=3)
    return t.ResNetForImageClassification(cfg), {"pixel_values": px(32)}


def regnet() -> harness.Built:
    import transformers as t
    cfg = t.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8)
    return t.RegNetModel(cfg), {"pixel_values": px(32)}


def segformer() -> harness.Built:
    import transformers as t
    cfg = t.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                            patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                            decoder_hidden_size=16, num_labels=3)
    return t.SegformerForSemanticSegmentation(cfg), {"pixel_values": px(32)}


def dinov2() -> harness.Built:
    import transformers as t
    cfg = t.Dinov2Config(image_size=16, patch_size=8, **vit_kw(), layerscale_value=1.0)
    return t.Dinov2Model(cfg), {"pixel_values": px()}


def dinov2_hidden() -> harness.Built:
    model, kwargs = dinov2()
    return model, {**kwargs, "output_hidden_states": True}  # transformers 5 takes it through **kwargs


def clip_loss() -> harness.Built:
    model, kwargs = clip()
    return model, {**kwargs, "return_loss": True}  # labels arange(len(logits)): export fixes the batch


def siglip_vision() -> harness.Built:
    import transformers as t
    cfg = t.SiglipVisionConfig(image_size=16, patch_size=8, **vit_kw())
    return t.SiglipVisionModel(cfg), {"pixel_values": px()}


def mobilevit() -> harness.Built:
    import transformers as t
    cfg = t.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 16, 16, 16, 32],
                            num_attention_heads=2)
    return t.MobileViTModel(cfg), {"pixel_values": px(32)}


def mobilenetv2() -> harness.Built:
    import transformers as t
    cfg = t.MobileNetV2Config(image_size=32, depth_multiplier=0.25)
    return t.MobileNetV2Model(cfg), {"pixel_values": px(32)}


def yolos() -> harness.Built:
    import transformers as t
    cfg = t.YolosConfig(image_size=[16, 16], patch_size=8, num_detection_tokens=2, **vit_kw())
    return t.YolosModel(cfg), {"pixel_values": px()}


def clip() -> harness.Built:
    import transformers as t
    text = dict(vocab_size=64, max_position_embeddings=16, **vit_kw())
    vision = dict(image_size=16, patch_size=8, **vit_kw())
    cfg = t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
    ids = torch.randint(0, 64, (B, 8), generator=torch.Generator().manual_seed(1))
    return t.CLIPModel(cfg), {"input_ids": ids, "pixel_values": px()}


def vitmae() -> harness.Built:
    import transformers as t
    cfg = t.ViTMAEConfig(image_size=16, patch_size=4, decoder_hidden_size=16, decoder_intermediate_size=32,
                         decoder_num_hidden_layers=1, decoder_num_attention_heads=2, **vit_kw())
    return t.ViTMAEModel(cfg), {"pixel_values": px()}


def vit_labels() -> harness.Built:
    import transformers as t
    cfg = t.ViTConfig(image_size=16, patch_size=8, num_labels=3, **vit_kw())
    return t.ViTForImageClassification(cfg), {"pixel_values": px(), "labels": torch.tensor([0, 2])}


# ---- diffusers --------------------------------------------------------------------------------------------------

def unet1d() -> harness.Built:
    import diffusers as d
    # the default Dance Diffusion blocks (attention too); its attention has channels // 32 heads, so 32 channels
    model = d.UNet1DModel(sample_size=64, in_channels=2, out_channels=2, extra_in_channels=64,
                          block_out_channels=(32, 32, 32), layers_per_block=1)
    return model, {"sample": torch.randn(B, 2, 64), "timestep": torch.tensor([3, 7])}


def vqmodel() -> harness.Built:
    import diffusers as d
    model = d.VQModel(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                      down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                      layers_per_block=1, norm_num_groups=4, num_vq_embeddings=16, vq_embed_dim=4, sample_size=16)
    return model, {"sample": px()}


def autoencoder_tiny() -> harness.Built:
    import diffusers as d
    model = d.AutoencoderTiny(in_channels=3, out_channels=3, encoder_block_out_channels=(8, 8),
                              decoder_block_out_channels=(8, 8), num_encoder_blocks=(1, 1),
                              num_decoder_blocks=(1, 1), latent_channels=4)
    return model, {"sample": px()}


def transformer2d() -> harness.Built:
    import diffusers as d
    model = d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                    num_layers=1, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
                                    norm_num_groups=4)
    return model, {"hidden_states": torch.randn(B, 4, 8, 8), "timestep": torch.tensor([3, 7]),
                   "class_labels": torch.tensor([1, 4])}


def transformer2d_cross() -> harness.Built:
    import diffusers as d
    model = d.Transformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=8, out_channels=8,
                                 num_layers=1, norm_num_groups=4, cross_attention_dim=12)
    return model, {"hidden_states": torch.randn(B, 8, 4, 4), "encoder_hidden_states": torch.randn(B, 5, 12)}


def pixart() -> harness.Built:
    import diffusers as d
    model = d.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                       num_layers=1, sample_size=8, patch_size=2, cross_attention_dim=16,
                                       caption_channels=12, norm_num_groups=4)
    return model, {"hidden_states": torch.randn(B, 4, 8, 8), "timestep": torch.tensor([3, 7]),
                   "encoder_hidden_states": torch.randn(B, 5, 12),
                   "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


def sd3() -> harness.Built:
    import diffusers as d
    model = d.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                    attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
                                    caption_projection_dim=16, pooled_projection_dim=10, pos_embed_max_size=8)
    return model, {"hidden_states": torch.randn(B, 4, 8, 8), "timestep": torch.tensor([3, 7]),
                   "encoder_hidden_states": torch.randn(B, 5, 12), "pooled_projections": torch.randn(B, 10)}


def flux() -> harness.Built:
    import diffusers as d
    model = d.FluxTransformer2DModel(patch_size=1, in_channels=4, out_channels=4, num_layers=1,
                                     num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
                                     joint_attention_dim=12, pooled_projection_dim=10, guidance_embeds=False,
                                     axes_dims_rope=(2, 2, 4))
    seq, txt = 16, 5  # ids with a batch dim (deprecated, diffusers takes ids[0]): 2-d ids have no batch to split
    return model, {"hidden_states": torch.randn(B, seq, 4), "encoder_hidden_states": torch.randn(B, txt, 12),
                   "pooled_projections": torch.randn(B, 10), "timestep": torch.tensor([0.3, 0.7]),
                   "img_ids": torch.randn(1, seq, 3).expand(B, -1, -1), "txt_ids": torch.zeros(B, txt, 3)}


def controlnet() -> harness.Built:
    import diffusers as d
    model = d.ControlNetModel(in_channels=2, conditioning_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                              norm_num_groups=4, cross_attention_dim=8, attention_head_dim=4,
                              down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                              conditioning_embedding_out_channels=(4, 8))
    return model, {"sample": torch.randn(B, 2, 8, 8), "timestep": torch.tensor([3, 7]),
                   "encoder_hidden_states": torch.randn(B, 4, 8), "controlnet_cond": torch.randn(B, 3, 16, 16)}


def unet2d_class_labels() -> harness.Built:
    import diffusers as d
    model = d.UNet2DConditionModel(
        sample_size=8, in_channels=2, out_channels=2, layers_per_block=1, block_out_channels=(8, 16),
        norm_num_groups=4, cross_attention_dim=8, attention_head_dim=4, num_class_embeds=5,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    return model, {"sample": torch.randn(B, 2, 8, 8), "timestep": torch.tensor([3, 7]),
                   "encoder_hidden_states": torch.randn(B, 4, 8), "class_labels": torch.tensor([1, 4])}


def unet2d_added_cond() -> harness.Built:
    import diffusers as d
    model = d.UNet2DConditionModel(
        sample_size=8, in_channels=2, out_channels=2, layers_per_block=1, block_out_channels=(8, 16),
        norm_num_groups=4, cross_attention_dim=8, attention_head_dim=4, addition_embed_type="text_time",
        addition_time_embed_dim=4, projection_class_embeddings_input_dim=6 + 4 * 2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    return model, {"sample": torch.randn(B, 2, 8, 8), "timestep": torch.tensor([3, 7]),
                   "encoder_hidden_states": torch.randn(B, 4, 8),
                   "added_cond_kwargs": {"text_embeds": torch.randn(B, 6), "time_ids": torch.randn(B, 2)}}


# diffusers' recent image and video models (added 2026-11-25): Sana, DC-AE, Wan 2.x and its 3-D VAE, CogVideoX,
# LTX-Video, AuraFlow, Stable Video Diffusion's UNet, UNet3D, Lumina 2, Qwen-Image
def sana() -> harness.Built:
    import diffusers as d

    m = d.SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=12,
        mlp_ratio=2.0,
        sample_size=8,
        patch_size=1,
        norm_elementwise_affine=False,
    )
    return m, {
        "hidden_states": torch.randn(B, 4, 8, 8),
        "encoder_hidden_states": torch.randn(B, 5, 12),
        "timestep": torch.tensor([3, 7]),
    }


def autoencoder_dc() -> harness.Built:
    import diffusers as d

    m = d.AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=4,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 16),
        decoder_block_out_channels=(8, 16),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        upsample_block_type="interpolate",
        downsample_block_type="Conv",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
    )
    return m, {"sample": torch.randn(B, 3, 16, 16)}


def wan() -> harness.Built:
    import diffusers as d

    m = d.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=12,
        freq_dim=16,
        ffn_dim=32,
        num_layers=1,
        rope_max_seq_len=32,
    )
    return m, {
        "hidden_states": torch.randn(B, 4, 2, 8, 8),
        "timestep": torch.tensor([3, 7]),
        "encoder_hidden_states": torch.randn(B, 5, 12),
    }


def autoencoder_kl_wan() -> harness.Built:
    import diffusers as d

    m = d.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False])
    return m, {"sample": torch.randn(B, 3, 1, 16, 16)}


def cogvideox() -> harness.Built:
    import diffusers as d

    m = d.CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=12,
        num_layers=1,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=5,
    )
    return m, {
        "hidden_states": torch.randn(B, 2, 4, 8, 8),
        "encoder_hidden_states": torch.randn(B, 5, 12),
        "timestep": torch.tensor([3, 7]),
    }


def ltx_video() -> harness.Built:
    import diffusers as d

    m = d.LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        caption_channels=12,
    )
    return m, {
        "hidden_states": torch.randn(B, 2 * 4 * 4, 4),
        "encoder_hidden_states": torch.randn(B, 5, 12),
        "timestep": torch.tensor([3, 7]),
        "encoder_attention_mask": torch.ones(B, 5),
        "num_frames": 2,
        "height": 4,
        "width": 4,
    }


def auraflow() -> harness.Built:
    import diffusers as d

    m = d.AuraFlowTransformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=1,
        num_single_dit_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        caption_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
    )
    return m, {
        "hidden_states": torch.randn(B, 4, 8, 8),
        "encoder_hidden_states": torch.randn(B, 5, 12),
        "timestep": torch.tensor([3, 7]),
    }


def unet_spatio_temporal() -> harness.Built:
    import diffusers as d

    m = d.UNetSpatioTemporalConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=8,
        num_attention_heads=(2, 2),
        addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=12,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
    )
    return m, {
        "sample": torch.randn(B, 2, 4, 8, 8),
        "timestep": torch.tensor([3, 7]),
        "encoder_hidden_states": torch.randn(B, 1, 8),
        "added_time_ids": torch.randn(B, 3),
    }


def unet3d() -> harness.Built:
    import diffusers as d

    m = d.UNet3DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        cross_attention_dim=8,
        attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
    )
    return m, {
        "sample": torch.randn(B, 4, 2, 8, 8),
        "timestep": torch.tensor([3, 7]),
        "encoder_hidden_states": torch.randn(B, 5, 8),
    }


def lumina2() -> harness.Built:
    import diffusers as d

    m = d.Lumina2Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        hidden_size=16,
        num_layers=1,
        num_refiner_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=8,
        cap_feat_dim=12,
        axes_dim_rope=(4, 2, 2),
        axes_lens=(32, 32, 32),
    )
    return m, {
        "hidden_states": torch.randn(B, 4, 8, 8),
        "timestep": torch.tensor([0.3, 0.7]),
        "encoder_hidden_states": torch.randn(B, 5, 12),
        "encoder_attention_mask": torch.ones(B, 5, dtype=torch.bool),
    }


def qwen_image() -> harness.Built:
    import diffusers as d

    m = d.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        axes_dims_rope=(2, 2, 4),
    )
    return m, {
        "hidden_states": torch.randn(B, 16, 16),
        "encoder_hidden_states": torch.randn(B, 5, 12),
        "encoder_hidden_states_mask": torch.ones(B, 5),
        "timestep": torch.tensor([0.3, 0.7]),
        "img_shapes": [(1, 4, 4)] * B,
    }


# vision-language models (added 2026-11-25): image tokens in a Llama or Gemma text model
VOCAB = 64


def _vision(config: str) -> Any:
    import transformers as t

    return getattr(t, config)(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=4)


def _text(config: str, **extra: Any) -> Any:
    import transformers as t

    return getattr(t, config)(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, **extra)


def _with_images(model: Any, first: int, pixels: torch.Tensor) -> harness.Built:
    """``model`` on 10 tokens per row whose positions ``first..first+3`` are the image token (the last id)."""
    ids = torch.randint(0, VOCAB - 2, (B, 10))
    ids[:, first:first + 4] = VOCAB - 1
    return model, {"input_ids": ids, "pixel_values": pixels, "use_cache": False}


def llava() -> harness.Built:
    import transformers as t

    cfg = t.LlavaConfig(vision_config=_vision("CLIPVisionConfig"), text_config=_text("LlamaConfig"),
                        image_token_index=VOCAB - 1, vision_feature_layer=-1, projector_hidden_act="gelu",
                        image_seq_length=4)
    cfg.vision_config.projection_dim = 16
    cfg.use_cache = cfg.text_config.use_cache = False
    return _with_images(t.LlavaForConditionalGeneration(cfg), 1, torch.randn(B, 3, 8, 8))


def paligemma() -> harness.Built:
    import transformers as t

    cfg = t.PaliGemmaConfig(vision_config=_vision("SiglipVisionConfig"), text_config=_text("GemmaConfig", head_dim=8),
                            image_token_index=VOCAB - 1, projection_dim=16)
    cfg.text_config.use_cache = False
    return _with_images(t.PaliGemmaForConditionalGeneration(cfg), 0, torch.randn(B, 3, 8, 8))


def idefics3() -> harness.Built:
    import transformers as t

    cfg = t.Idefics3Config(vision_config=_vision("Idefics3VisionConfig"), text_config=_text("LlamaConfig"),
                           image_token_id=VOCAB - 1, scale_factor=1)
    return _with_images(t.Idefics3ForConditionalGeneration(cfg), 1, torch.randn(B, 1, 3, 8, 8))

REGISTRY = {
    "deit": deit, "beit": beit, "swin": swin, "swinv2": swinv2, "convnext": convnext, "convnextv2": convnextv2,
    "resnet": resnet, "regnet": regnet, "segformer": segformer, "dinov2": dinov2, "dinov2_hidden": dinov2_hidden, "siglip_vision": siglip_vision,
    "mobilevit": mobilevit, "mobilenetv2": mobilenetv2, "yolos": yolos, "clip": clip, "clip_loss": clip_loss, "vitmae": vitmae,
    "vit_labels": vit_labels,
    "unet1d": unet1d, "vqmodel": vqmodel, "autoencoder_tiny": autoencoder_tiny, "dit": transformer2d, "transformer2d": transformer2d_cross,
    "pixart": pixart, "sd3": sd3, "flux": flux, "controlnet": controlnet,
    "unet2d_class_labels": unet2d_class_labels, "unet2d_added_cond": unet2d_added_cond,
}

REGISTRY.update({name: globals()[name] for name in (
    "sana", "autoencoder_dc", "wan", "autoencoder_kl_wan", "cogvideox", "ltx_video", "auraflow", "unet_spatio_temporal",
    "unet3d", "lumina2", "qwen_image", "llava", "paligemma", "idefics3")})

if __name__ == "__main__":
    raise SystemExit(harness.main(REGISTRY))
