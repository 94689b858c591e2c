"""GRPO with Sangam as the rollout engine (docs/rollouts.md), in plain PyTorch.

The policy is the demo model (sangam-demo); the reward is exact match on its tasks
(``--families``). Each step samples ``--samples`` responses to each of ``--prompts`` task
prompts (one request with n samples, each its own seed, with ``return_trajectory``), scores
them, normalizes each group's rewards into advantages, and takes ``--epochs`` clipped
policy-gradient steps on the trainer's copy of the weights. A diffusion model's likelihood of a
response has no closed form; what the engine did does: each token was committed by one
forward, whose input the trajectory's step map rebuilds (the positions committed before it,
the rest masked), so the trainer recomputes the log-probability the rollout sampled it with
(cache "none": every forward sees the whole sequence, as the trainer's dense forward does) and
checks it against the rollout's. The new weights go back to the engine in place
(``update_weights_from_tensor``), its KV pool and weights released while the trainer steps.

    python examples/grpo.py                      # a few steps: the loop, end to end
    python examples/grpo.py --steps 150 --eval-every 10 --out grpo.json --figure grpo.png
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


def grpo_loss(model: torch.nn.Module, outs: list, advantages: list[float], old: list | None,
              mask_id: int, shift: int, temperature: float, clip: float
              ) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    """GRPO's clipped surrogate, each sample's tokens averaged (its 1/|o|), over samples; the
    policy's log-probabilities (``old`` on the next epochs: the ratio's denominator, None on
    the first, where the ratio is 1); and the largest gap between the trainer's recomputed
    log-probabilities (untempered) and the rollout's (the on-policy check: float32 rounding,
    on the first epoch)."""
    losses, policies, gap = [], [], 0.0
    for k, (out, adv) in enumerate(zip(outs, advantages)):
        policy, model_lp, rollout = trajectory_logprobs(
            model, out.prompt_token_ids, out.trajectory, mask_id, shift, temperature)
        if old is None:
            gap = max(gap, float((model_lp.detach() - rollout).abs().max()))
        before = policy.detach() if old is None else old[k]
        ratio = torch.exp(policy - before)
        losses.append(-torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean())
        policies.append(policy.detach())
    return torch.stack(losses).mean(), policies, gap


def advantages_of(rewards: list[float]) -> list[float]:
    """A group's rewards, normalized: (r - mean) / std (all 0 when they are equal)."""
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [(r - mean) / std if std > 0 else 0.0 for r in rewards]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16, help="task prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt (the group)")
    # At 3 the demo answers 72% of its tasks (greedy: 96%): room for the policy to sharpen.
    ap.add_argument("--temperature", type=float, default=3.0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=1,
                    help="gradient steps on each batch of rollouts (GRPO's mu)")
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="held-out exact match, sampled, every this many steps (0: never)")
    ap.add_argument("--num-workers", type=int, default=1)
    ap.add_argument("--families", default="reverse,sort,copy,count",
                    help="the demo's task families to train on, comma-separated")
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

    def held_out_reward() -> float:
        evals = llm.chat([[{"role": "user", "content": t.prompt}] for t in held_out],
                         dataclasses.replace(params, n=1, return_trajectory=False))
        return statistics.fmean(float((o.text or "") == t.answer)
                                for t, o in zip(held_out, evals))

    if args.eval_every:  # where training starts from
        curve.append({"step": 0, "eval_reward": held_out_reward()})
        print(f"step 0: held-out {curve[0]['eval_reward']:.3f}", flush=True)
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
        old = None
        for _ in range(args.epochs):
            optimizer.zero_grad()
            loss, policies, epoch_gap = grpo_loss(
                trainer, samples, advantages, old, cfg.mask_token_id, int(cfg.shift_logits),
                args.temperature, args.clip)
            loss.backward()
            optimizer.step()
            if old is None:
                old, gap = policies, epoch_gap
        llm.resume_memory_occupation()
        version = llm.update_weights_from_tensor(
            [(n, p.detach()) for n, p in trainer.state_dict().items()])
        point = {"step": step, "reward": statistics.fmean(rewards), "logprob_gap": gap,
                 "weight_version": version, "rollout_s": round(rollout_s, 2),
                 "step_s": round(time.perf_counter() - start, 2)}
        if args.eval_every and step % args.eval_every == 0:
            point["eval_reward"] = held_out_reward()
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

    train = [p for p in curve if "reward" in p]
    steps = [p["step"] for p in train]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(steps, [p["reward"] for p in train], alpha=0.35, label="batch reward")
    k = 10
    smooth = [statistics.fmean(p["reward"] for p in train[max(0, i - k + 1):i + 1])
              for i in range(len(train))]
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
