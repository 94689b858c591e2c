"""A trainer's weight broadcast over NCCL (docs/rollouts.md): a trainer process on one GPU is
rank 0 of a weight-update group, the engine on another GPU joins it
(``init_weights_update_group``, backend nccl) and takes every tensor
(``update_weights_from_distributed``); the engine's tokens must then be those of an engine
started from the trainer's weights.

Needs two GPUs; otherwise prints why it skips and exits 0. ``--device cpu`` runs the same over
gloo on the CPU (the dry run). A tiny random LLaDA checkpoint: seconds. Prints one JSON line;
exits 1 if the check fails.

    PYTHONPATH=. python microbench/weight_update_nccl.py
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp

SEED = 7


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(path: str, port: int, device: str, backend: str) -> None:
    """Rank 0: the new weights, broadcast in state-dict order."""
    from sangam import WeightUpdateGroup
    from sangam.models import load_model

    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # the communicator's device
    model = load_model(path, device, "float32")
    group = WeightUpdateGroup("127.0.0.1", port, 0, 2, "rl", backend, device)
    for t in model.state_dict().values():
        group.broadcast(t.contiguous())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(json.dumps({"check": "weight_update_nccl",
                          "skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}))
        return 0
    from sangam import LLM, SamplingParams
    from sangam.models import load_model
    from sangam.models.loader import save_checkpoint
    from sangam.testing import make_tiny_checkpoint

    gpu = args.device == "cuda"
    engine_device, trainer_device = ("cuda:0", "cuda:1") if gpu else ("cpu", "cpu")
    backend = "nccl" if gpu else "gloo"
    tmp = tempfile.mkdtemp(prefix="weight_update_")
    base = make_tiny_checkpoint(f"{tmp}/base", arch="llada", seed=1)
    model = load_model(base, "cpu", "float32")  # the trainer's step: every weight moved
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    with open(f"{base}/config.json") as f:
        save_checkpoint(model, json.load(f), f"{tmp}/new")
    names = list(model.state_dict())
    shapes = [list(t.shape) for t in model.state_dict().values()]

    prompts = [[5 + i, 9, 13, 2, 7] * (1 + i) for i in range(6)]
    params = SamplingParams(max_tokens=16, block_length=8, temperature=0.0)

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                  sampling_params=params)]

    want = tokens(LLM(f"{tmp}/new", device=engine_device, dtype="float32"))
    llm = LLM(base, device=engine_device, dtype="float32")
    before = tokens(llm)
    port = _port()
    trainer = mp.get_context("spawn").Process(
        target=_trainer, args=(f"{tmp}/new", port, trainer_device, backend))
    trainer.start()
    llm.init_weights_update_group("127.0.0.1", port, 1, 2, "rl", backend)
    version = llm.update_weights_from_distributed(names, ["float32"] * len(names), shapes)
    trainer.join(120)
    after = tokens(llm)
    ok = trainer.exitcode == 0 and after == want and before != want and version == 1
    print(json.dumps({"check": "weight_update_nccl", "backend": backend, "ok": ok,
                      "tensors": len(names), "tokens_equal_fresh_engine": after == want}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
