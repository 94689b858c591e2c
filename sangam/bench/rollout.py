"""``sangam-bench rollout``: RL rollouts' throughput (docs/rollouts.md): ``--samples`` responses
to each of ``--prompts`` task prompts of the demo model, at temperature, with trajectories,
through the engine in a closed loop at each ``--concurrency`` (that many requests in flight,
one submitted as one finishes), against the upstream batched generate loop (Fast-dLLM's LLaDA
``generate_with_dual_cache``) on the same requests, batches of the same size, side by side in
one run.

The upstream loop decodes a batch in lockstep: each block starts with a forward over every
sequence (its cache), then a forward over every sequence's block per step until no sequence
of the batch has a mask left in it, committing what the threshold rule picks; all blocks of
``max_tokens``, with no stop at EOS, as upstream does. It runs here on the engine's model and
its packed varlen attention (upstream pads prompts to one length, which only costs it more).
Tokens counted are the responses' (up to their first stop), on both sides.

    sangam-bench rollout --prompts 16 --samples 8 --concurrency 16,64,128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.noise import noise_key, row_keys
from sangam.models.attention import AttentionMetadata, PagedKV


def rollout_requests(llm, families: tuple[str, ...], prompts: int, samples: int,
                     params) -> list[tuple[str, list[int], object]]:
    """(request id, prompt ids, params) of every sample: the demo's task prompts through the
    chat template, each prompt's samples with their own seeds (``for_sample``)."""
    from sangam.demo.tasks import eval_set

    per_family = -(-prompts // len(families))
    tasks = eval_set(per_family, families=families)[:prompts]
    out = []
    for i, task in enumerate(tasks):
        ids = llm.loaded.text.encode_chat([{"role": "user", "content": task.prompt}], None,
                                          True, False, None, None)
        out += [(f"p{i}s{j}", ids, params.for_sample(j)) for j in range(samples)]
    return out


def run_engine(llm, requests: list, concurrency: int) -> dict:
    """The requests through the engine, ``concurrency`` in flight at a time."""
    engine = llm.engine
    pending, in_flight, tokens, forwards = list(requests), set(), 0, 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            rid, ids, params = pending.pop(0)
            engine.add_request(rid, ids, params)
            in_flight.add(rid)
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
                tokens += len(out.token_ids)
                forwards += out.num_forwards
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "forwards_per_request": forwards / len(requests)}


class UpstreamBatchedGenerate:
    """Fast-dLLM's batched ``generate_with_dual_cache`` for LLaDA (module docstring), on the
    engine's model: one page range per sequence, packed forwards."""

    def __init__(self, model, page_size: int = 16):
        cfg = model.config
        if cfg.block_causal or cfg.shift_logits or cfg.gemma is not None:
            raise ValueError("the upstream loop is Fast-dLLM's LLaDA generate: a bidirectional, "
                             f"unshifted model; {cfg.architecture} is not one")
        self.model, self.page_size = model, page_size
        p = model.head_weight()
        self.device, self.dtype = p.device, p.dtype

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seeds: list[int], max_tokens: int,
                 block_length: int, threshold: float, temperature: float) -> list[np.ndarray]:
        """The responses (canvas tokens) of one batch."""
        cfg, b = self.model.config, block_length
        mask = cfg.mask_token_id
        blocks = -(-max_tokens // b)
        seqs = [np.array(p + [mask] * (blocks * b), dtype=np.int64) for p in prompts]
        lens = [len(s) for s in seqs]
        per_seq = -(-max(lens) // self.page_size)
        kv = PagedKV.for_model(cfg, per_seq * len(seqs), self.page_size, self.dtype,
                               self.device)
        tables = torch.arange(per_seq * len(seqs), dtype=torch.int32).view(len(seqs), per_seq)
        for block in range(blocks):
            starts = [len(p) + block * b for p in prompts]
            step = 0
            while True:
                # The block's first forward covers every sequence whole (its dual cache); the
                # others only the block.
                spans = [(0, n) if step == 0 else (s, s + b) for n, s in zip(lens, starts)]
                logits = self._forward(seqs, spans, starts, b, kv, tables, lens)
                open_ = self._commit(seqs, starts, b, logits, seeds, block, step, threshold,
                                     temperature)
                step += 1
                if not open_:
                    break
        return [s[len(p):len(p) + max_tokens] for s, p in zip(seqs, prompts)]

    def _forward(self, seqs, spans, starts, b, kv, tables, lens) -> torch.Tensor:
        """One packed forward of the spans; the logits of every sequence's block rows."""
        ids, positions, slots, rows, cu = [], [], [], [], [0]
        for i, ((a, e), s) in enumerate(zip(spans, starts)):
            base = i * tables.shape[1] * self.page_size
            ids.append(seqs[i][a:e])
            positions.append(np.arange(a, e))
            slots.append(base + np.arange(a, e))
            rows.append(cu[-1] + np.arange(s - a, s - a + b))
            cu.append(cu[-1] + e - a)
        dev = self.device
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            kv_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev), slot_mapping=torch.from_numpy(
                np.concatenate(slots)).to(dev),
            query_lens=[e - a for a, e in spans], kv_lens_host=list(lens))
        return self.model(torch.from_numpy(np.concatenate(ids)).to(dev),
                          torch.from_numpy(np.concatenate(positions)).to(dev), meta, kv,
                          torch.from_numpy(np.concatenate(rows)).to(dev))

    def _commit(self, seqs, starts, b, logits, seeds, block, step, threshold,
                temperature) -> bool:
        """Upstream's threshold rule per sequence (at least one per step); whether a mask is
        left in any sequence's block."""
        mask = self.model.config.mask_token_id
        n = len(seqs)
        keys = np.concatenate([row_keys(noise_key(seed, block, step), np.arange(b))
                               for seed in seeds])
        tokens, conf, _ = score_logits(
            logits, mask, torch.full((n * b,), temperature, dtype=torch.float64),
            torch.from_numpy(keys))
        tokens, conf = tokens.cpu().numpy().reshape(n, b), conf.cpu().numpy().reshape(n, b)
        left = False
        for i, s in enumerate(starts):
            masked = seqs[i][s:s + b] == mask
            if not masked.any():
                continue
            c = np.where(masked, conf[i], -1.0)
            pick = masked & (c >= threshold)
            pick[int(c.argmax())] = True
            seqs[i][s:s + b][pick] = tokens[i][pick]
            left |= bool((seqs[i][s:s + b] == mask).any())
        return left


def run_upstream(llm, requests: list, batch: int) -> dict:
    """The requests through the upstream loop, ``batch`` at a time."""
    upstream = UpstreamBatchedGenerate(llm.engine.loaded.model)
    stop_ids = llm.engine.loaded.stop_ids
    tokens = 0
    start = time.perf_counter()
    for k in range(0, len(requests), batch):
        group = requests[k:k + batch]
        p = group[0][2]
        outs = upstream.generate([ids for _, ids, _ in group], [q.seed for _, _, q in group],
                                 p.max_tokens, p.block_length, p.threshold, p.temperature)
        for out in outs:
            stop = [i for i, t in enumerate(out.tolist()) if t in stop_ids]
            tokens += stop[0] if stop else len(out)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def run(args: argparse.Namespace) -> int:
    from sangam import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, device="cpu", dtype="float32",
              max_batch_size=max(args.concurrency))
    defaults = llm.get_default_sampling_params()
    params = dataclasses.replace(
        defaults, temperature=args.temperature, cache="dual", return_trajectory=True,
        seed=args.seed, max_tokens=args.max_tokens or defaults.max_tokens,
        block_length=args.block_length or defaults.block_length)
    requests = rollout_requests(llm, tuple(args.families.split(",")), args.prompts,
                                args.samples, params)
    rows = []
    for c in args.concurrency:
        sangam = run_engine(llm, requests, c)
        upstream = run_upstream(llm, requests, c)
        rows.append({"concurrency": c, "sangam": sangam, "upstream": upstream,
                     "ratio": sangam["tokens_per_s"] / upstream["tokens_per_s"]})
    print(f"{len(requests)} rollouts ({args.prompts} prompts x {args.samples} samples), "
          f"temperature {params.temperature}, max_tokens {params.max_tokens}, block "
          f"{params.block_length}, threshold {params.threshold}, DualCache")
    print(f"{'in flight':>9} | {'sangam tok/s':>12} | {'fwd/req':>7} | {'upstream tok/s':>14} "
          f"| {'ratio':>5}")
    for r in rows:
        print(f"{r['concurrency']:>9} | {r['sangam']['tokens_per_s']:>12.1f} | "
              f"{r['sangam']['forwards_per_request']:>7.1f} | "
              f"{r['upstream']['tokens_per_s']:>14.1f} | {r['ratio']:>5.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"},
                       "rows": rows}, f, indent=1)
    return 0


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("positive integers, comma-separated")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout", help="RL rollouts (n samples x prompts, with trajectories) "
                       "through the engine against the upstream batched generate loop")
    p.add_argument("--model", default="sangam-demo",
                   help="a bidirectional LLaDA-layout model (the upstream loop's)")
    p.add_argument("--families", default="reverse,sort,copy,count",
                   help="the demo's task families the prompts come from")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8, help="responses per prompt (n)")
    p.add_argument("--concurrency", type=_ints, default=[16, 64, 128],
                   help="requests in flight (the engine), batch size (upstream)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--block-length", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=run)
