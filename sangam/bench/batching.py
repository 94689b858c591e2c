"""``sangam-bench batching``: what batching buys on the CPU path, which every real (not
simulated) measurement of scheduling gains runs on.

A random-weight model of a chosen size (by default 4 layers, d_model 256) decodes the same
requests one at a time (the Fast-dLLM policy, batch 1) and with 8 and 32 in flight at once
(the deficit policy), side by side in one run. Reported per setting: generated tokens per
second, its ratio to one at a time, milliseconds per request per forward (falling with the
batch when batching amortizes the forward), and the share of the time spent in attention
(the attention backend's own calls, timed).

    sangam-bench batching --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from sangam.sampling_params import CACHE_MODES, SamplingParams


class _TimedAttention:
    """Wraps an attention backend and sums the seconds its calls take."""

    def __init__(self, inner):
        self.inner, self.name, self.seconds = inner, inner.name, 0.0

    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.inner.forward(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return out


def run_setting(llm, prompts: list[list[int]], params: SamplingParams) -> dict:
    model = llm.engine.loaded.model
    timed = _TimedAttention(model.attention_backend)
    model.attention_backend = timed
    try:
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
    finally:
        model.attention_backend = timed.inner
    tokens = sum(len(o.token_ids) for o in outs)
    forwards = sum(o.num_forwards for o in outs)
    return {"seconds": seconds, "tokens_per_s": tokens / seconds,
            "ms_per_request_forward": 1000 * seconds / forwards,
            "attention_share": timed.seconds / seconds}


def run(args: argparse.Namespace) -> int:
    from sangam import LLM
    from sangam.testing import make_tiny_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    n = max(levels)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1000, (args.prompt_len,), generator=gen).tolist()
               for _ in range(n)]
    params = SamplingParams(max_tokens=args.gen_len, block_length=args.block_length,
                            cache=args.cache, stop_at_eos=False)
    with tempfile.TemporaryDirectory() as ckpt:
        make_tiny_checkpoint(ckpt, arch=args.arch, seed=0, vocab_size=1024,
                             hidden_size=args.hidden, num_layers=args.layers,
                             num_heads=args.heads, num_kv_heads=args.kv_heads,
                             intermediate_size=4 * args.hidden)
        rows = []
        for c in levels:
            policy = "fastdllm" if c == 1 else "deficit"
            llm = LLM(model=ckpt, device="cpu", dtype=args.dtype, policy=policy,
                      max_batch_size=c)
            llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)  # warm up
            rows.append((c, policy, run_setting(llm, prompts, params)))
            llm.shutdown()
    base = rows[0][2]["tokens_per_s"]
    print(f"{args.arch}, {args.layers} layers, d_model {args.hidden}, {args.heads} heads "
          f"({args.kv_heads or args.heads} K/V), {args.dtype}; {n} requests of "
          f"{args.prompt_len} prompt + {args.gen_len} tokens (block {args.block_length}, "
          f"{args.cache}), torch threads {torch.get_num_threads()}\n")
    print("| in flight | policy | seconds | tokens/s | vs 1 | ms per request-forward | "
          "attention |")
    print("|---|---|---|---|---|---|---|")
    for c, policy, r in rows:
        print(f"| {c} | {policy} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base:.2f}x | {r['ms_per_request_forward']:.2f} | "
              f"{100 * r['attention_share']:.0f}% |")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batching", help="CPU path: tokens/s with 1, 8, 32 requests in flight",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32",
                   help="requests in flight per setting; 1 runs the Fast-dLLM policy")
    p.add_argument("--arch", default="llada", choices=("llada", "dream"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--block-length", type=int, default=SamplingParams().block_length)
    p.add_argument("--cache", default=SamplingParams().cache, choices=CACHE_MODES)
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.set_defaults(func=run)
