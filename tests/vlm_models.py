"""Tiny random image-text-to-text decoder-only transformers models (LLaVA, LLaVA-NeXT, Qwen2-VL,
PaliGemma, Gemma3, Idefics3) with their inputs, as their processors would give them: a left-padded
batch whose rows hold each image's placeholder tokens."""

from __future__ import annotations

from typing import Any

import torch

V = 96  # vocabulary of every tiny model
IMG = 90  # the image placeholder token
FAMILIES = ("llava", "llava_next", "qwen2_vl", "paligemma", "gemma3", "idefics3")


def _text(**kw: Any) -> dict[str, Any]:
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                initializer_range=0.3)
    return {**base, **kw}


def _vision(**kw: Any) -> dict[str, Any]:
    return {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                   patch_size=8, num_channels=3), **kw}


def build(name: str, seed: int = 0, window: int = 8) -> Any:
    """A tiny random model of the family ``name`` (eval mode, eager attention); ``window``: Gemma3's
    sliding window."""
    import transformers as T

    torch.manual_seed(seed)
    if name == "llava":
        model = T.LlavaForConditionalGeneration(T.LlavaConfig(
            vision_config=T.CLIPVisionConfig(**_vision(projection_dim=32)), text_config=T.LlamaConfig(**_text()),
            image_token_index=IMG, vision_feature_layer=-1))
    elif name == "llava_next":
        model = T.LlavaNextForConditionalGeneration(T.LlavaNextConfig(
            vision_config=T.CLIPVisionConfig(**_vision(projection_dim=32)), text_config=T.LlamaConfig(**_text()),
            image_token_index=IMG, vision_feature_layer=-1, image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]]))
    elif name == "qwen2_vl":
        vision = T.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4,
                                       spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}
        model = T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
            vision_config=vision, text_config=T.Qwen2VLTextConfig(**_text(rope_parameters=rope)), image_token_id=IMG,
            video_token_id=91, vision_start_token_id=92, vision_end_token_id=93))
    elif name == "paligemma":
        model = T.PaliGemmaForConditionalGeneration(T.PaliGemmaConfig(
            vision_config=T.SiglipVisionConfig(**_vision()), text_config=T.GemmaConfig(**_text(head_dim=8)),
            image_token_index=IMG, vocab_size=V, projection_dim=32, hidden_size=32))
    elif name == "gemma3":
        text = T.Gemma3TextConfig(**_text(head_dim=8, sliding_window=window, query_pre_attn_scalar=8,
                                          layer_types=["sliding_attention", "full_attention"]))
        model = T.Gemma3ForConditionalGeneration(T.Gemma3Config(
            vision_config=T.SiglipVisionConfig(**_vision(patch_size=4)), text_config=text, image_token_index=IMG,
            boi_token_index=91, eoi_token_index=92, mm_tokens_per_image=4))
    elif name == "idefics3":
        model = T.Idefics3ForConditionalGeneration(T.Idefics3Config(
            vision_config=T.Idefics3VisionConfig(**_vision(patch_size=4)), text_config=T.LlamaConfig(**_text()),
            image_token_id=IMG, scale_factor=2))
    elif name == "mllama":  # cross-attention to the image's tiles
        vision = T.MllamaVisionConfig(**_vision(num_global_layers=1, max_num_tiles=2, intermediate_layers_indices=[0],
                                                vision_output_dim=64, supported_aspect_ratios=[[1, 1], [1, 2]]))
        model = T.MllamaForConditionalGeneration(T.MllamaConfig(
            vision_config=vision, text_config=T.MllamaTextConfig(**_text(cross_attention_layers=[1])),
            image_token_index=IMG))
    else:
        raise KeyError(name)
    model.config._attn_implementation = "eager"
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.generation_config.pad_token_id = 0
    return model.eval()


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids (pad 0) and their attention mask."""
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def inputs(name: str, model: Any, batch: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    """``batch`` prompts of different lengths, one image each, with the inputs the family's
    processor gives (``image_sizes``, ``image_grid_thw`` and ``mm_token_type_ids``, ``token_type_ids``)."""
    g = torch.Generator().manual_seed(seed)
    texts = [torch.randint(3, 80, (3 + b,), generator=g).tolist() for b in range(batch)]
    out: dict[str, torch.Tensor] = {}
    if name == "llava_next":
        out["image_sizes"] = torch.tensor([[16, 32], [32, 16], [32, 32]])[:batch]
        out["pixel_values"] = torch.randn(batch, 5, 3, 16, 16, generator=g)
        with torch.no_grad():
            features = model.model.get_image_features(out["pixel_values"], out["image_sizes"], vision_feature_layer=-1,
                                                      vision_feature_select_strategy="default").pooler_output
        rows = [[1] + [IMG] * f.shape[0] + t for f, t in zip(features, texts)]
    elif name == "qwen2_vl":
        grids = [[1, 4, 4], [1, 4, 8], [1, 8, 4]][:batch]
        out["image_grid_thw"] = torch.tensor(grids)
        out["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 4 * 4, generator=g)  # patches
        rows = [[1, 92] + [IMG] * (t * h * w // 4) + [93] + tx for (t, h, w), tx in zip(grids, texts)]
    elif name == "mllama":  # one image of 1 or 2 tiles per prompt (aspect ratios 1 and 2)
        out["pixel_values"] = torch.randn(batch, 1, 2, 3, 16, 16, generator=g)
        out["aspect_ratio_ids"] = torch.tensor([[1], [2]])[:batch]
        out["aspect_ratio_mask"] = torch.tensor([[[1, 0]], [[1, 1]]])[:batch]
        rows = [[1, IMG] + t for t in texts]
    else:
        out["pixel_values"] = torch.randn(batch, 3, 16, 16, generator=g)
        if name == "paligemma":
            rows = [[IMG] * 4 + [1] + t for t in texts]
        elif name == "gemma3":
            rows = [[1, 91] + [IMG] * 4 + [92] + t for t in texts]
        else:
            rows = [[1] + [IMG] * 4 + t for t in texts]
        if name == "idefics3":
            out["pixel_values"] = out["pixel_values"][:, None]  # (batch, images, channels, height, width)
    out["input_ids"], out["attention_mask"] = padded(rows)
    if name == "mllama":  # each token from the image on attends to its row's tiles
        ids = out["input_ids"]
        mask = torch.zeros(batch, ids.shape[1], 1, 2, dtype=torch.long)
        for b in range(batch):
            mask[b, int((ids[b] == IMG).nonzero()[0, 0]):, 0, :b + 1] = 1
        out["cross_attention_mask"] = mask
    if name == "qwen2_vl":
        out["mm_token_type_ids"] = (out["input_ids"] == IMG).long()
    elif name == "paligemma":
        out["token_type_ids"] = torch.zeros_like(out["input_ids"])  # the prefix, attended both ways
    elif name == "gemma3":
        out["token_type_ids"] = (out["input_ids"] == IMG).long()
    return out
