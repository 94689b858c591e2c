"""Tensor parallelism across two devices (docs/design.md §4.10): two ranks, each holding its
shard of a random checkpoint and joined by the model's all-reduces over NCCL (gloo with
``--device cpu``), give the whole model's logits and the vocabulary-parallel scoring gives
score_logits' tokens; then the forward time of TP1 against TP2 at LLaDA-8B's shape (random
weights, bf16, one 1024-token sequence); then, where pyzmq is installed, the engine itself
(``LLM(tensor_parallel_size=2)``, CUDA graphs on) against TP1, token for token.

Needs two GPUs (prints why it skips and exits 0 with fewer). Prints one JSON line; exits 1
if a check fails.

    PYTHONPATH=. python microbench/tp_check.py [--device cpu]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TINY = dict(arch="dream", num_heads=8, num_kv_heads=2, vocab_size=301, num_layers=3,
            hidden_size=128, intermediate_size=256)
TOKENS = 64
TIMED_TOKENS = 1024


def _rank(rank: int, device: str, port: int, tiny: str, big: str | None, out) -> None:
    from sangam.engine.scoring import make_scorer
    from sangam.engine.tensor_group import TensorGroup
    from sangam.models import ShardLayout, load_model
    from sangam.models.kernel_table import backend_name, kernel_table

    cuda = device == "cuda"
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    layout = ShardLayout(rank, 2)
    group = TensorGroup(0, layout, 1, dev, datetime.timedelta(seconds=60))
    model = load_model(tiny, dev, "float32", shard=layout)
    model.all_reduce = group.all_reduce
    ids = torch.arange(TOKENS, device=dev)[None] % (model.config.vocab_size - 1)
    with torch.no_grad():
        logits = model.forward_dense(ids)[0]
        rows = logits.shape[0]
        temps = torch.zeros(rows, dtype=torch.float64, device=dev)
        keys = torch.zeros(rows, dtype=torch.int64, device=dev)
        scorer = make_scorer(kernel_table(backend_name(dev)), group,
                             model.config.mask_token_id, model.config.vocab_size)
        tokens, _ = scorer.score(logits, None, {"temperatures": temps, "row_keys": keys})
        whole = group.gather_vocab(logits, model.config.vocab_size)
    result = {"logits": whole.cpu(), "tokens": tokens.cpu()}
    if big is not None:
        big_model = load_model(big, dev, "bfloat16", "dummy", layout)
        big_model.all_reduce = group.all_reduce
        result["tp2_forward_ms"] = _time_forward(big_model, dev)
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def _time_forward(model, dev: torch.device) -> float:
    """Median of 5 forwards of one TIMED_TOKENS-token sequence, ms (after 2 warm-ups)."""
    ids = torch.randint(0, model.config.vocab_size - 1, (1, TIMED_TOKENS), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(0))
    times = []
    with torch.no_grad():
        for i in range(7):
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            model.forward_dense(ids)
            torch.cuda.synchronize(dev)
            if i >= 2:
                times.append((time.perf_counter() - t) * 1000)
    return sorted(times)[len(times) // 2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_check(tiny: str) -> dict:
    """LLM at TP2 against TP1 on GPU: the same tokens (float32, CUDA graphs on)."""
    try:
        import zmq  # noqa: F401  (the front speaks to its workers over ZeroMQ)
    except ImportError:
        return {"engine": "skipped: pyzmq is not installed"}
    from sangam import LLM, SamplingParams

    params = SamplingParams(max_tokens=32, block_length=8, unmasking="topk", tokens_per_step=2)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7 + 2 * i]} for i in range(8)]
    got = {}
    for tp in (1, 2):
        llm = LLM(tiny, dtype="float32", num_pages=256, tensor_parallel_size=tp)
        try:
            got[tp] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            if hasattr(llm, "shutdown"):
                llm.shutdown()
    return {"engine_tokens_equal": got[1] == got[2]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    from sangam.decoding.confidence import score_logits
    from sangam.models import load_model
    from sangam.testing import make_tiny_checkpoint, real_shape_config

    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        print(json.dumps({"check": "tp", "skipped": f"needs 2 GPUs, found "
                          f"{torch.cuda.device_count()}"}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_checkpoint(f"{tmp}/tiny", seed=1, **TINY)
        big = None
        if cuda:
            big = f"{tmp}/big"
            os.makedirs(big)
            with open(f"{big}/config.json", "w") as f:
                json.dump(real_shape_config("llada"), f)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, args.device, port, tiny, big, out))
                 for port in [_free_port()] for r in range(2)]
        for proc in procs:
            proc.start()
        result = out.get(timeout=300)
        for proc in procs:
            proc.join(60)
        dev = torch.device("cuda:0" if cuda else "cpu")
        whole = load_model(tiny, dev, "float32")
        ids = torch.arange(TOKENS, device=dev)[None] % (whole.config.vocab_size - 1)
        with torch.no_grad():
            want = whole.forward_dense(ids)[0].cpu()
        tokens, _, _ = score_logits(want, whole.config.mask_token_id)
        report = {"check": "tp", "device": args.device,
                  "max_logit_error": float((result["logits"] - want).abs().max()),
                  "tokens_equal": bool(torch.equal(result["tokens"], tokens))}
        if big is not None:
            one = load_model(big, dev, "bfloat16", "dummy")
            report["tp1_forward_ms"] = _time_forward(one, dev)
            report["tp2_forward_ms"] = result["tp2_forward_ms"]
            del one
            report.update(_engine_check(tiny))
    ok = (report["max_logit_error"] < 1e-3 and report["tokens_equal"]
          and report.get("engine_tokens_equal", True))
    report["ok"] = ok
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
