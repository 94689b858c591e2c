"""Train ``sangam-demo-gemma``: a small DiffusionGemma-layout model (uniform-state diffusion) on
the demo's toy chat tasks.

    .venv/bin/python scripts/train_demo_gemma.py --out sangam/demo/model_gemma

The model is transformers' ``DiffusionGemmaForBlockDiffusion`` layout (config.json written by
transformers' own ``DiffusionGemmaConfig``), sized for a CPU: sliding-window and full layers,
a dense MLP beside four experts, a 24-token canvas — one canvas per answer. The tokenizer is
the demo's characters in Gemma's layout (``write_tokenizer(layout="gemma")``).

Uniform-state objective, as the model decodes: the prompt (chat template) goes through the
causal encoder; the canvas (answer, <end_of_turn>, then <eos> to the canvas's end) is corrupted
by replacing each position with a uniformly random token with probability t ~ U(0, 1)
(stratified over the batch); the decoder predicts the clean canvas at every position
(cross-entropy). Half the batches first run a no-gradient pass whose softmax becomes the
self-conditioning of the trained pass, as a denoising step conditions on the one before.
Encoder and decoder run as one pass (the prompt's rows causal, the canvas's over the prompt and
the whole canvas: exactly ``encode`` then ``decode``). Seeded: a rerun reproduces the weights
on the same machine and thread count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sangam.demo.tasks import Task, eval_set, training_stream
from sangam.demo.tokenizer import GEMMA_VOCAB, build_tokenizer, write_tokenizer
from sangam.demo.training import lr_at, make_optimizer
from sangam.models import parse_config, save_checkpoint
from sangam.models.diffusion_gemma import DiffusionGemmaModel

PAD, EOS, BOS = 0, 1, 2
END_OF_TURN = GEMMA_VOCAB.index("<end_of_turn>")
START_OF_TURN = GEMMA_VOCAB.index("<start_of_turn>")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 4000
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    canvas_length: int = 24
    hidden_size: int = 128
    num_layers: int = 4  # sliding, sliding, sliding, full
    sliding_window: int = 16
    threads: int = 2
    self_conditioning: float = 0.5  # share of batches trained with self-conditioning
    families: str = "reverse,copy,sort,sort,count"


def model_config(cfg: TrainConfig) -> dict:
    """config.json as transformers writes it for these sizes."""
    from transformers import DiffusionGemmaConfig

    text = dict(vocab_size=len(GEMMA_VOCAB), hidden_size=cfg.hidden_size,
                intermediate_size=4 * cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                layer_types=["sliding_attention"] * (cfg.num_layers - 1) + ["full_attention"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                num_global_key_value_heads=1, sliding_window=cfg.sliding_window,
                num_experts=4, top_k_experts=2, moe_intermediate_size=cfg.hidden_size,
                max_position_embeddings=1024, pad_token_id=PAD, eos_token_id=EOS,
                bos_token_id=BOS)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=8)
    raw = DiffusionGemmaConfig(text_config=text, vision_config=vision,
                               canvas_length=cfg.canvas_length).to_dict()
    raw["architectures"] = ["DiffusionGemmaForBlockDiffusion"]
    return raw


def init_weights(model: DiffusionGemmaModel) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith((".scale", "per_expert_scale")):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(1.0)


def encode_batch(tasks: list[Task], canvas: int) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """Prompts ``[B, P]`` (right-padded), their lengths ``[B]``, and the clean canvases
    ``[B, C]``: answer, <end_of_turn>, <eos> to the end."""
    tok = build_tokenizer("gemma")
    prompts = [[BOS, START_OF_TURN, *tok.encode(f"user\n{t.prompt.strip()}",
                                                add_special_tokens=False).ids, END_OF_TURN,
                *tok.encode("\n", add_special_tokens=False).ids, START_OF_TURN,
                *tok.encode("model\n", add_special_tokens=False).ids] for t in tasks]
    answers = [tok.encode(t.answer, add_special_tokens=False).ids + [END_OF_TURN]
               for t in tasks]
    if any(len(a) > canvas for a in answers):
        raise ValueError("an answer does not fit the canvas")
    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.full((len(tasks), int(lens.max())), PAD, dtype=torch.long)
    clean = torch.full((len(tasks), canvas), EOS, dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids[i, :len(p)] = torch.tensor(p)
        clean[i, :len(a)] = torch.tensor(a)
    return ids, lens, clean


def forward(model: DiffusionGemmaModel, prompt: torch.Tensor, lens: torch.Tensor,
            canvas: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
    """Logits ``[B, C, V]`` of the canvas after the prompt: encoder and decoder in one pass."""
    batch, plen = prompt.shape
    clen = canvas.shape[1]
    g = model.config.gemma
    pos_p = torch.arange(plen)[None, :].expand(batch, plen)
    pos_c = lens[:, None] + torch.arange(clen)[None, :]
    positions = torch.cat([pos_p, pos_c], 1)
    valid = torch.cat([pos_p < lens[:, None], torch.ones(batch, clen, dtype=torch.bool)], 1)
    is_canvas = torch.cat([torch.zeros(batch, plen, dtype=torch.bool),
                           torch.ones(batch, clen, dtype=torch.bool)], 1)
    q_pos, k_pos = positions[:, :, None], positions[:, None, :]
    causal = (k_pos <= q_pos) & ~is_canvas[:, None, :]  # encoder rows see the prompt so far
    full = torch.where(is_canvas[:, :, None], valid[:, None, :], causal) & valid[:, None, :]
    window_lo = torch.where(is_canvas, lens[:, None] - g.sliding_window + 1,
                            positions - g.sliding_window + 1)
    sliding = full & (k_pos >= window_lo[:, :, None])
    masks = {True: sliding[:, None], False: full[:, None]}
    h = torch.cat([model.embed(prompt), model.decoder_inputs(canvas, soft)], 1)

    def attend(i, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[g.sliding[i]], scale=1.0)
        return out.transpose(1, 2)

    return model.head(model.run_layers(h, positions, attend, ~is_canvas)[:, plen:])


def loss_on(model: DiffusionGemmaModel, batch: tuple, gen: torch.Generator,
            cfg: TrainConfig) -> torch.Tensor:
    prompt, lens, clean = batch
    b, c = clean.shape
    t = (torch.arange(b) + torch.rand((), generator=gen)) / b
    noise = torch.randint(0, model.config.vocab_size, clean.shape, generator=gen)
    noisy = torch.where(torch.rand(b, c, generator=gen) < t[:, None], noise, clean)
    soft = None
    if torch.rand((), generator=gen) < cfg.self_conditioning:
        with torch.no_grad():
            first = forward(model, prompt, lens, noisy, None)
            soft = model.soft_embeddings(first.reshape(b * c, -1)).reshape(b, c, -1)
    logits = forward(model, prompt, lens, noisy, soft)
    return F.cross_entropy(logits.reshape(b * c, -1), clean.reshape(-1))


@torch.no_grad()
def canvas_accuracy(model: DiffusionGemmaModel, batch: tuple) -> float:
    """Share of answer tokens right in one step from a fully random canvas."""
    prompt, lens, clean = batch
    noisy = torch.randint(0, model.config.vocab_size, clean.shape,
                          generator=torch.Generator().manual_seed(0))
    pred = forward(model, prompt, lens, noisy, None).argmax(-1)
    answer = clean != EOS
    return (pred == clean)[answer].float().mean().item()




def train(cfg: TrainConfig, log=print) -> tuple[DiffusionGemmaModel, dict]:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    raw = model_config(cfg)
    model = DiffusionGemmaModel(parse_config(raw))
    init_weights(model)
    opt = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    families = tuple(cfg.families.split(","))
    data = training_stream(cfg.seed, families)
    heldout = encode_batch(eval_set(8, families=tuple(dict.fromkeys(families))),
                           cfg.canvas_length)
    model.train()
    start, running = time.time(), 0.0
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = encode_batch([next(data) for _ in range(cfg.batch_size)], cfg.canvas_length)
        loss = loss_on(model, batch, gen, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        running += loss.item()
        if (step + 1) % 100 == 0 or step + 1 == cfg.steps:
            n = step % 100 + 1
            log(f"step {step + 1}/{cfg.steps} loss {running / n:.4f} one-step answer-token "
                f"accuracy {canvas_accuracy(model, heldout):.3f} {time.time() - start:.0f}s")
            running = 0.0
    return model.eval().requires_grad_(False), raw


def main(argv: list[str] | None = None) -> int:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="sangam/demo/model_gemma")
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    curve: list[str] = []

    def log(line: str) -> None:
        curve.append(line)
        print(line, flush=True)

    start = time.time()
    model, raw = train(cfg, log)
    out = Path(args.out)
    save_checkpoint(model, raw, out)
    write_tokenizer(out, layout="gemma")
    (out / "generation_config.json").write_text(json.dumps({
        "max_new_tokens": cfg.canvas_length, "max_denoising_steps": 16,
        "sampler_config": {"entropy_bound": 0.5, "_cls_name": "EntropyBoundSamplerConfig"},
        "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005,
        "eos_token_id": [EOS, END_OF_TURN]}, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps({
        "train_config": asdict(cfg), "families": cfg.families.split(","),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "args": sys.argv[1:] if argv is None else argv,
        "wall_seconds": round(time.time() - start), "curve": curve}, indent=2) + "\n")
    print(f"saved to {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
