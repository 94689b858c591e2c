"""Write the config.json of a DiffusionGemma of Gemma 4 26B-A4B's text geometry, written by
transformers' own ``DiffusionGemmaConfig``, for shape-only tools (``sangam-bench memory
--model-config``, ``sangam-bench sim --model-config``, ``--load-format dummy``):

    .venv/bin/python scripts/diffusion_gemma_26b_config.py /tmp/dgemma-26b

No DiffusionGemma-26B-A4B release config can be read here. The geometry is Gemma 4 26B-A4B's,
as its config.json states it and loaders check it field by field (30 layers, five sliding
then one full; hidden 2816; 16 query heads; sliding layers 8 KV heads of 256, full layers 2 of
512 with K = V; 128 experts of width 704, 8 a token, beside a dense MLP of 2112; a vocabulary
of 262,144; 262,144 positions), assumed to be DiffusionGemma-26B-A4B's; the sliding window is
DiffusionGemma's 512 (Gemma 4's is 1024) and the canvas 256. A real checkpoint's config.json
supersedes every number here.
"""

from __future__ import annotations

import argparse

LAYERS = 30
TEXT = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112,
            num_hidden_layers=LAYERS, num_attention_heads=16, num_key_value_heads=8,
            head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
            sliding_window=512, attention_k_eq_v=True, enable_moe_block=True, num_experts=128,
            top_k_experts=8, moe_intermediate_size=704, max_position_embeddings=262144,
            final_logit_softcapping=30.0,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                         for i in range(LAYERS)])
CANVAS = 256


def main(argv: list[str] | None = None) -> int:
    from transformers import DiffusionGemmaConfig

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the directory to write config.json into")
    args = p.parse_args(argv)
    config = DiffusionGemmaConfig(text_config=TEXT, canvas_length=CANVAS)
    config.architectures = ["DiffusionGemmaForBlockDiffusion"]
    config.save_pretrained(args.out)
    print(f"wrote {args.out}/config.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
