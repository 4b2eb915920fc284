"""Tiny random encoder-decoder transformers models for the tests, the docs test and the bench
(T5, BART, Pegasus, Marian, Whisper, a vision-encoder-decoder ViT + GPT-2), with their inputs."""

from __future__ import annotations

from typing import Any

import torch
from tolerance import gamma

V = 96  # vocabulary of every tiny model

# The bound for sequences_scores and transition scores, genkit against transformers on these
# models. genkit and transformers run the same kernels on the same shapes but one: genkit runs the
# decoder's first step on one row per prompt and repeats its cache, transformers on the expanded rows.
# Only the row count (M) of those products differs; the reduction over K per element is the same, so
# the first-step logits agree to a few roundings and the scores to far under 1e-5. (The worst-case
# bound over any reduction order -- tolerance.forward_relative_bound for 2 decoder + 2 cross-attention
# blocks of width 32, ~1,400 terms, 2 gamma_1400 ~ 1.7e-4 relative to |logits| ~ 10 -- is ~1e-3, so
# 1e-5 holds only because the order is the same; a CPU whose kernels change the K order with M would
# need that bound instead.)
SCORE_ATOL = 1e-5
# ... in absolute terms. T5's tiny model (initializer_factor 8) has logits in the hundreds, where one
# float32 rounding of a logit is already ~3e-5: a log-softmax over V terms is then within
# 2 gamma_V of its magnitude (the log-sum-exp is a V-term sum), the relative part of the bound.
SCORE_RTOL = 2 * gamma(V)


def _common(**kw: Any) -> dict[str, Any]:
    return dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                init_std=0.25, **kw)


def build(name: str, seed: int = 0) -> Any:
    """A tiny random model of the family ``name`` (eval mode, eager attention)."""
    import transformers as T

    torch.manual_seed(seed)
    if name == "t5":
        cfg = T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, initializer_factor=8.0,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = T.T5ForConditionalGeneration(cfg)
    elif name == "bart":
        model = T.BartForConditionalGeneration(T.BartConfig(**_common(pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                                                      decoder_start_token_id=2)))
    elif name == "pegasus":
        model = T.PegasusForConditionalGeneration(T.PegasusConfig(**_common(pad_token_id=0, eos_token_id=1,
                                                                            decoder_start_token_id=0)))
    elif name == "marian":
        model = T.MarianMTModel(T.MarianConfig(**_common(pad_token_id=V - 1, eos_token_id=0, decoder_start_token_id=V - 1,
                                                         decoder_vocab_size=V)))
    elif name == "whisper":
        model = T.WhisperForConditionalGeneration(T.WhisperConfig(
            vocab_size=V, num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
            max_target_positions=64, pad_token_id=V - 1, bos_token_id=V - 2, eos_token_id=V - 2,
            decoder_start_token_id=V - 3, init_std=0.25, suppress_tokens=None, begin_suppress_tokens=None))
    elif name == "vision":
        enc = T.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, initializer_range=0.25)
        dec = T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, add_cross_attention=True,
                           is_decoder=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.25)
        model = T.VisionEncoderDecoderModel(T.VisionEncoderDecoderConfig(encoder=enc.to_dict(), decoder=dec.to_dict()))
        model.config.decoder_start_token_id, model.config.pad_token_id, model.config.eos_token_id = 1, 0, 2
        model.generation_config.decoder_start_token_id = 1
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    elif name == "moonshine":  # the encoder's output carries its own (downsampled) attention mask
        model = T.MoonshineForConditionalGeneration(T.MoonshineConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=2, decoder_num_hidden_layers=2,
            encoder_num_attention_heads=4, decoder_num_attention_heads=4, max_position_embeddings=128,
            decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3))
    elif name == "switch":  # the encoder's output is a MoEModelOutput (router_logits)
        model = T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
            vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=2,
            expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, initializer_factor=8.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    elif name == "pix2struct":  # image to text: the encoder reads `flattened_patches`
        text = dict(vocab_size=V, hidden_size=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0,
                    eos_token_id=1, decoder_start_token_id=0, initializer_factor=4.0)
        vision = dict(hidden_size=32, patch_embed_hidden_size=12, d_kv=8, d_ff=64, num_hidden_layers=2,
                      num_attention_heads=4, patch_size=2, initializer_factor=4.0)
        model = T.Pix2StructForConditionalGeneration(T.Pix2StructConfig(text_config=text, vision_config=vision))
    elif name == "florence2":  # the image's features replace its tokens in the text encoder's input
        text = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, init_std=0.25)
        vision = dict(in_channels=3, depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                      patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[2, 4], num_groups=[2, 4],
                      window_size=2, projection_dim=32, max_temporal_embeddings=4, max_position_embeddings=16)
        model = T.Florence2ForConditionalGeneration(T.Florence2Config(text_config=text, vision_config=vision,
                                                                      image_token_id=V - 6))
    elif name == "git":  # decoder-only, the image's tokens first
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                      patch_size=8, num_channels=3)
        model = T.GitForCausalLM(T.GitConfig(vision_config=vision, vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                             bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3))
    else:
        raise KeyError(name)
    model.config._attn_implementation = "eager"
    return model.eval()


def inputs(name: str, batch: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    """The encoder's inputs for ``name``: left-padded token ids and mask (text), features (audio), pixels."""
    g = torch.Generator().manual_seed(seed)
    if name == "whisper":
        return {"input_features": torch.randn(batch, 8, 32, generator=g)}
    if name == "vision":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    if name == "pix2struct":  # 16 patches: (row, column, 2x2x3 pixels); the second image has 12
        patches = torch.randn(batch, 16, 2 + 12, generator=g)
        patches[:, :, 0], patches[:, :, 1] = torch.arange(16) // 4 + 1, torch.arange(16) % 4 + 1
        mask = torch.ones(batch, 16, dtype=torch.long)
        mask[1:, 12:] = 0
        return {"flattened_patches": patches, "attention_mask": mask}
    if name == "florence2":  # 17 image tokens (what its vision tower gives a 32x32 image), then text; right-padded
        pixels = torch.randn(batch, 3, 32, 32, generator=g)
        rows = [[0] + [V - 6] * 17 + torch.randint(3, V - 8, (3 + b,), generator=g).tolist() + [2] for b in range(batch)]
        width = max(map(len, rows))
        ids = torch.tensor([r + [1] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}
    if name == "moonshine":  # raw audio; the second row's second half is padding
        mask = torch.ones(batch, 6000, dtype=torch.long)
        mask[1:, 2500:] = 0
        return {"input_values": torch.randn(batch, 6000, generator=g), "attention_mask": mask}
    ids = torch.randint(3, V - 2, (batch, 7), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:  # the second row is shorter: padded on the left
        mask[1, :3] = 0
        pad = build_pad(name)
        ids[1, :3] = pad
    return {"input_ids": ids, "attention_mask": mask}


def build_pad(name: str) -> int:
    return {"t5": 0, "bart": 1, "pegasus": 0, "marian": V - 1, "switch": 0}[name]


TEXT = ("t5", "bart", "pegasus", "marian")
ALL = (*TEXT, "whisper", "vision")


def save_with_tokenizer(model: Any, folder: str, names: dict[int, str] | None = None) -> Any:
    """Save ``model`` and a word-level ``tokenizer.json`` (words ``w0`` ... ``w95``, ``w0``-``w2`` special
    as the model's pad/eos; ``names`` renames some ids) into ``folder``; returns the ``tokenizers`` tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(V)}
    for i, name in (names or {}).items():
        vocab = {(name if v == i else k): v for k, v in vocab.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["w0", "w1"])
    tok.save(f"{folder}/tokenizer.json")
    return tok
