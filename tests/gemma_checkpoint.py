"""A tiny DiffusionGemma checkpoint written by transformers' own ``save_pretrained`` (the test
files' shared model, and what the reference decoder makes of requests; no imports beyond
torch, transformers and Sangam, so the prepared GPU run can collect the tests that use it)."""

from __future__ import annotations

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

from sangam.decoding.uniform import UniformStateParams
from sangam.engine.reference_canvas import generate_canvases

VOCAB, CANVAS = 96, 8


def write_checkpoint(path, seed=0, **text):
    """A tiny DiffusionGemma by transformers' save_pretrained: sliding layers (window 6) and
    full ones with their own head_dim and KV heads, alternating; four experts; every weight random,
    norms and scalars included, the encoder's layer scalars unlike the decoder's."""
    tc = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
              num_global_key_value_heads=1, sliding_window=6,
              layer_types=["sliding_attention", "full_attention", "sliding_attention",
                           "full_attention"],
              num_experts=4, top_k_experts=2, moe_intermediate_size=12,
              max_position_embeddings=256, eos_token_id=1, pad_token_id=0)
    tc.update(text)
    vc = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32,
              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(
        DiffusionGemmaConfig(text_config=tc, vision_config=vc, canvas_length=CANVAS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.3 / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    model.save_pretrained(path)
    return path


def reference_tokens(model, reqs: list) -> dict[str, list[int]]:
    """What the one-request reference decoder gives each of ``reqs`` ((id, prompt,
    SamplingParams) each), as Sangam's ``token_ids``: without a stop id that ended it."""
    want = {}
    for rid, prompt, params in reqs:
        ref = generate_canvases(model, prompt, UniformStateParams(**params.uniform_given()),
                                params.seed, params.max_tokens, params.stop_token_ids)
        want[rid] = ref.tokens[:len(ref.tokens) - (ref.finish_reason == "stop")]
    return want
