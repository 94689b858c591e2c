"""Train Sangam's demo models: small LLaDA-layout masked-diffusion models on toy chat tasks.

    .venv/bin/python scripts/train_demo_model.py --out sangam/demo/model
    .venv/bin/python scripts/train_demo_model.py --out sangam/demo/model_long --preset long

Masked-diffusion SFT as in LLaDA: the prompt stays clean; the response (answer, <|eot_id|>, then
<|endoftext|> up to exactly ``--response-length`` tokens, the served canvas; rows shorter than
the batch are padded after that, and the pad is masked out of attention and loss) is masked with
probability t ~ U(0, 1) per sequence; the loss is the cross-entropy on masked positions weighted
by 1/t, normalised by the response length. The batch's t are stratified (one per 1/B-wide slice
of (0, 1), as MDLM's low-discrepancy sampler): the same expectation, a less noisy gradient.
Full bidirectional attention (``forward_dense``). Everything is seeded and the data order is
fixed, so a rerun with the same arguments and thread count on the same machine reproduces the
weights bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sangam.demo import DEMO_BLOCK_LENGTH
from sangam.demo.tasks import Task, eval_set, training_stream
from sangam.demo.tokenizer import (
    EOS_ID,
    EOT_ID,
    MASK_ID,
    VOCAB_SIZE,
    chat_prompt,
    encode,
    write_tokenizer,
)
from sangam.demo.training import lr_at, make_optimizer
from sangam.models import parse_config, save_checkpoint
from sangam.models.llada import LLaDAModel
from sangam.testing import tiny_config

MASK_EPS = 1e-3  # t is drawn from U(eps, 1) so the 1/t weight stays bounded (as in LLaDA)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 10000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 200
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    response_length: int = 24
    block_length: int = DEMO_BLOCK_LENGTH  # generation_config.json's: how the model is served
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    rope_theta: float = 10000.0  # LLaDA-8B uses 5e5 for 4K contexts; these are < 100 tokens
    bf16_autocast: bool = True  # bf16 matmuls, fp32 master weights
    threads: int = 1
    # The training mix (repeat a name to draw it more often): sorting is the family a small
    # model learns slowest.
    families: str = "reverse,copy,sort,sort,count"


# Named settings, each a set of TrainConfig overrides (flags still override them).
PRESETS = {
    "short": {},  # sangam-demo: the shipped default model
    # sangam-demo-long: answers of 64-150 characters on a 160-token canvas of 16-token blocks.
    "long": {"response_length": 160, "block_length": 16,
             "families": "copy_long,shift,tally", "steps": 6000,
             "threads": 2},
}


def model_config(cfg: TrainConfig) -> dict:
    """The demo's config.json: LLaDA keys, the character vocabulary, mask = last id, EOS = 1."""
    raw = tiny_config("llada", vocab_size=VOCAB_SIZE, hidden_size=cfg.hidden_size,
                      num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                      intermediate_size=cfg.intermediate_size, max_position=1024)
    assert raw["mask_token_id"] == MASK_ID and raw["eos_token_id"] == EOS_ID
    return {**raw, "rope_theta": cfg.rope_theta}


def init_weights(model: LLaDAModel, num_layers: int) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
    blocks = model.model.transformer.blocks
    residual_out = {id(b.attn_out.weight) for b in blocks} | {id(b.ff_out.weight) for b in blocks}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_f." in name:
                p.fill_(1.0)
            elif id(p) in residual_out:
                p.normal_(0.0, 0.02 / math.sqrt(2 * num_layers))
            else:
                p.normal_(0.0, 0.02)


def encode_batch(tasks: list[Task], response_length: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids ``[B, T]``, prompt lengths ``[B]`` and the mask ``[B, T]`` of real tokens.

    Row i is its prompt, answer, <|eot_id|> and EOS up to exactly ``response_length`` response
    tokens: the canvas ``LLM.generate`` decodes with ``max_tokens=response_length``. Rows
    shorter than T are padded after that and the pad is masked out of attention and loss, so no
    row ever sees more canvas than at serving time (a model trained with a longer EOS tail
    after short prompts learns where the sequence ends and misplaces its answers when it ends
    sooner).
    """
    prompts = [encode(chat_prompt(t.prompt)) for t in tasks]
    answers = [encode(t.answer) + [EOT_ID] for t in tasks]
    too_long = [t.answer for t, a in zip(tasks, answers) if len(a) > response_length]
    if too_long:
        raise ValueError(f"answers {too_long[:3]} do not fit a {response_length}-token response")
    prompt_lens = torch.tensor([len(p) for p in prompts])
    total = int(prompt_lens.max()) + response_length
    ids = torch.full((len(tasks), total), EOS_ID, dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
    valid = torch.arange(total)[None, :] < (prompt_lens + response_length)[:, None]
    return ids, prompt_lens, valid


def diffusion_loss(model: LLaDAModel, ids: torch.Tensor, prompt_lens: torch.Tensor,
                   valid: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """LLaDA's SFT loss on one batch; masks are drawn from ``gen``."""
    batch, total = ids.shape
    response = valid & (torch.arange(total)[None, :] >= prompt_lens[:, None])
    strata = (torch.arange(batch) + torch.rand((), generator=gen)) / batch
    p_mask = (1 - MASK_EPS) * strata + MASK_EPS
    masked = (torch.rand(batch, total, generator=gen) < p_mask[:, None]) & response
    logits = model.forward_dense(torch.where(masked, MASK_ID, ids), key_mask=valid)
    ce = F.cross_entropy(logits[masked].float(), ids[masked], reduction="none")
    weight = 1.0 / (p_mask[:, None] * response.sum(1, keepdim=True)).expand(batch, total)
    return (ce * weight[masked]).sum() / batch


@torch.no_grad()
def answer_accuracy(model: LLaDAModel, ids: torch.Tensor, prompt_lens: torch.Tensor,
                    valid: torch.Tensor) -> float:
    """Share of answer tokens (and <|eot_id|>) predicted right in one shot from a fully masked
    response: a cheap held-out progress signal (decoding proper unmasks step by step)."""
    total = ids.shape[1]
    response = valid & (torch.arange(total)[None, :] >= prompt_lens[:, None])
    pred = model.forward_dense(torch.where(response, MASK_ID, ids), key_mask=valid).argmax(-1)
    eot = (ids == EOT_ID) & response
    answer = response & (torch.cumsum(eot, 1) - eot.long() == 0)
    return (pred == ids)[answer].float().mean().item()




def train(cfg: TrainConfig, log: Callable[[str], None] = print,
          log_every: int = 50) -> tuple[LLaDAModel, dict]:
    """Train from scratch; returns the model (fp32, eval mode) and its raw config.json dict."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    raw = model_config(cfg)
    model = LLaDAModel(parse_config(raw))
    init_weights(model, cfg.num_layers)
    opt = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    data = training_stream(cfg.seed, tuple(cfg.families.split(",")))
    families = tuple(dict.fromkeys(cfg.families.split(",")))
    heldout = encode_batch(eval_set(8, families=families), cfg.response_length)
    model.train()
    start, running = time.time(), 0.0
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = encode_batch([next(data) for _ in range(cfg.batch_size)], cfg.response_length)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            loss = diffusion_loss(model, *batch, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        running += loss.item()
        if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
            n = (step % log_every) + 1
            acc = answer_accuracy(model, *heldout)
            log(f"step {step + 1}/{cfg.steps} loss {running / n:.4f} held-out answer-token "
                f"accuracy {acc:.3f} lr {lr_at(step, cfg):.2e} {time.time() - start:.0f}s")
            running = 0.0
    return model.eval().requires_grad_(False), raw


def main(argv: list[str] | None = None) -> int:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="sangam/demo/model", help="checkpoint directory")
    parser.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="short",
                        help="named TrainConfig overrides: short (sangam-demo), long "
                             "(4-10-block answers); the flags below override them")
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=type(value), default=None,
                                help=f"default {value} (before the preset)")
    args = parser.parse_args(argv)
    chosen = {k: getattr(args, k) for k in asdict(defaults) if getattr(args, k) is not None}
    cfg = TrainConfig(**{**PRESETS[args.preset], **chosen})
    print(f"training the demo model: {cfg}", flush=True)
    start = time.time()
    curve: list[str] = []  # the training curve, kept in training.json

    def log(line: str) -> None:
        curve.append(line)
        print(line, flush=True)

    model, raw = train(cfg, log=log)
    wall = time.time() - start
    save_checkpoint(model.to(getattr(torch, args.save_dtype)), raw, args.out)
    write_tokenizer(args.out)
    generation = {"max_new_tokens": cfg.response_length, "block_length": cfg.block_length}
    (Path(args.out) / "generation_config.json").write_text(json.dumps(generation) + "\n")
    info = {"train_config": asdict(cfg), "save_dtype": args.save_dtype,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "args": sys.argv[1:] if argv is None else argv,
            "wall_seconds": round(wall), "curve": curve}
    (Path(args.out) / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved to {args.out} after {wall:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
