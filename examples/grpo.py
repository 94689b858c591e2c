"""GRPO with Sangam as the rollout engine (docs/rollouts.md), in plain PyTorch.

The policy is the demo model (sangam-demo); the reward is exact match on one of its task
families (``--families``; by default count, the one it gets most wrong). Each step
samples ``--samples`` responses to each of ``--prompts`` task prompts (one request with n
samples, each its own seed, with ``return_trajectory``), scores them, normalizes each group's
rewards into advantages, and takes one policy-gradient step on the trainer's copy of the
weights. A diffusion model's likelihood of a response has no closed form; what the engine did
does: each token was committed by one forward, whose input the trajectory's step map rebuilds
(the positions committed before it, the rest masked), so the trainer recomputes the
log-probability the rollout sampled it with (cache "none": every forward sees the whole
sequence, as the trainer's dense forward does), and checks it against the rollout's. The new
weights go back to the engine in place (``update_weights_from_tensor``), its KV pool and
weights released while the trainer steps.

    python examples/grpo.py                      # a few steps: the loop, end to end
    python examples/grpo.py --steps 60 --out grpo.json --figure grpo.png   # docs/results.md
    python examples/grpo.py --num-workers 2      # rollouts by a two-worker deployment
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import torch

from sangam import LLM
from sangam.demo.tasks import eval_set, training_stream
from sangam.models import load_model


def trajectory_logprobs(model: torch.nn.Module, prompt: list[int], trajectory: list,
                        mask_id: int, shift: int, temperature: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every value a trajectory wrote: the trainer's log-probability of it under the
    sampling distribution (tempered: the policy's), under the model's own (untempered: what
    the engine reports), and the engine's. One dense forward per rollout forward, its input
    rebuilt from the step map."""
    steps = sorted({s for values in trajectory for s, _, _ in values})
    canvases, rows, positions, tokens, rollout = [], [], [], [], []
    for row, step in enumerate(steps):
        canvas = []
        for i, values in enumerate(trajectory):
            before = [t for s, t, _ in values if s < step]
            canvas.append(before[-1] if before else mask_id)
            for s, t, lp in values:
                if s == step:
                    rows.append(row)
                    positions.append(len(prompt) + i - shift)
                    tokens.append(t)
                    rollout.append(lp)
        canvases.append(prompt + canvas)
    logits = model.forward_dense(torch.tensor(canvases)).float()[rows, positions]
    logits[:, mask_id] = float("-inf")  # never committed: not in the distribution
    index = torch.arange(len(tokens)), torch.tensor(tokens)
    policy = torch.log_softmax(logits / max(temperature, 1e-5), dim=-1)[index]
    return policy, torch.log_softmax(logits, dim=-1)[index], torch.tensor(rollout)


def grpo_loss(model: torch.nn.Module, outs: list, advantages: list[float], mask_id: int,
              shift: int, temperature: float) -> tuple[torch.Tensor, float]:
    """The policy gradient's surrogate (one step per batch: on-policy), each sample's tokens
    averaged (GRPO's 1/|o|), over samples; and the largest gap between the trainer's
    recomputed log-probabilities and the rollout's (the on-policy check: float32 rounding)."""
    losses, gap = [], 0.0
    for out, adv in zip(outs, advantages):
        policy, model_lp, rollout = trajectory_logprobs(
            model, out.prompt_token_ids, out.trajectory, mask_id, shift, temperature)
        gap = max(gap, float((model_lp.detach() - rollout).abs().max()))
        losses.append(-(adv * policy).mean())
    return torch.stack(losses).mean(), gap


def advantages_of(rewards: list[float]) -> list[float]:
    """A group's rewards, normalized: (r - mean) / std (all 0 when they are equal)."""
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [(r - mean) / std if std > 0 else 0.0 for r in rewards]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="task prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt (the group)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="held-out exact match, sampled, every this many steps (0: never)")
    ap.add_argument("--num-workers", type=int, default=1)
    ap.add_argument("--families", default="count",
                    help="the demo's task families to train on, comma-separated (count: the "
                         "one it gets wrong most, 0.75 exact match sampled at temperature 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the reward curve here (JSON)")
    ap.add_argument("--figure", help="draw the reward curve here (PNG)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    llm = LLM(model="sangam-demo", device="cpu", dtype="float32", num_workers=args.num_workers)
    cfg = llm.loaded.config
    trainer = load_model(llm.loaded.path, "cpu", "float32").train().requires_grad_(True)
    optimizer = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    params = dataclasses.replace(llm.get_default_sampling_params(), n=args.samples,
                                 temperature=args.temperature, cache="none",
                                 return_trajectory=True, seed=None)
    families = tuple(args.families.split(","))
    tasks = training_stream(args.seed, families)
    held_out = eval_set(64 // len(families), families=families)
    curve = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        batch = list(itertools.islice(tasks, args.prompts))
        outs = llm.chat([[{"role": "user", "content": t.prompt}] for t in batch], params)
        samples, advantages, rewards = [], [], []
        for task, out in zip(batch, outs):
            group = [out, *out.siblings]
            r = [float((o.text or "") == task.answer) for o in group]
            samples += group
            rewards += r
            advantages += advantages_of(r)
        rollout_s = time.perf_counter() - start
        llm.release_memory_occupation()  # the trainer's turn (a GPU's memory, colocated)
        optimizer.zero_grad()
        loss, gap = grpo_loss(trainer, samples, advantages, cfg.mask_token_id,
                              int(cfg.shift_logits), args.temperature)
        loss.backward()
        optimizer.step()
        llm.resume_memory_occupation()
        version = llm.update_weights_from_tensor(
            [(n, p.detach()) for n, p in trainer.state_dict().items()])
        point = {"step": step, "reward": statistics.fmean(rewards), "logprob_gap": gap,
                 "weight_version": version, "rollout_s": round(rollout_s, 2),
                 "step_s": round(time.perf_counter() - start, 2)}
        if args.eval_every and step % args.eval_every == 0:
            evals = llm.chat([[{"role": "user", "content": t.prompt}] for t in held_out],
                             dataclasses.replace(params, n=1, return_trajectory=False))
            point["eval_reward"] = statistics.fmean(
                float((o.text or "") == t.answer) for t, o in zip(held_out, evals))
        curve.append(point)
        print(f"step {step}: reward {point['reward']:.3f}, weights version {version}, "
              f"|trainer - rollout logprob| <= {gap:.1e}"
              + (f", held-out {point['eval_reward']:.3f}" if "eval_reward" in point else "")
              + f" ({point['step_s']:.1f} s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "curve": curve}, f, indent=1)
    if args.figure:
        plot(curve, args.figure)
    llm.shutdown()


def plot(curve: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in curve]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(steps, [p["reward"] for p in curve], alpha=0.35, label="batch reward")
    k = 5
    smooth = [statistics.fmean(p["reward"] for p in curve[max(0, i - k + 1):i + 1])
              for i in range(len(curve))]
    ax.plot(steps, smooth, label=f"batch reward, mean of {k}")
    evals = [(p["step"], p["eval_reward"]) for p in curve if "eval_reward" in p]
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out, sampled")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("exact match (reward)")
    ax.set_title("GRPO on sangam-demo, rollouts by Sangam")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
