"""``sangam-bench quality``: exact-match accuracy and tokens per forward of each decoding mode.

Decodes held-out instances of the demo tasks (:mod:`sangam.demo.tasks`) through the public API
(``sangam.LLM``) with vanilla LLaDA decoding (top-1 per step, no cache) and with PrefixCache and
DualCache under the threshold and factor rules, and reports per-family and overall exact match
and tokens committed per model forward. Use it on the shipped demo model (the default) or on any
checkpoint trained on these tasks with the demo tokenizer.

Tokens per forward counts every canvas token decoded (answer, end-of-turn and the EOS padding of
the blocks that were decoded) over the forwards spent, so vanilla decoding scores exactly 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass

from sangam.demo import DEMO_BLOCK_LENGTH, DEMO_MAX_TOKENS
from sangam.demo.tasks import DEMO_FAMILIES, EVAL_SEED, FAMILIES, Task, eval_set
from sangam.sampling_params import RequestOutput, SamplingParams


@dataclass(frozen=True)
class Mode:
    name: str
    options: dict


MODES = (
    Mode("vanilla", {"unmasking": "topk", "tokens_per_step": 1, "cache": "none"}),
    *(Mode(f"{cache}/threshold={th}", {"unmasking": "threshold", "threshold": th, "cache": cache})
      for cache in ("prefix", "dual") for th in (0.5, 0.7, 0.9, 1.0)),
    *(Mode(f"{cache}/factor=1.0", {"unmasking": "factor", "factor": 1.0, "cache": cache})
      for cache in ("prefix", "dual")),
)


def tokens_decoded(out: RequestOutput, params: SamplingParams) -> int:
    """Canvas tokens committed for ``out``: every block up to the one holding the first stop."""
    if out.finish_reason == "stop":
        blocks = len(out.token_ids) // params.block_length + 1
        return min(blocks * params.block_length, params.canvas_length)
    return params.canvas_length


def evaluate_mode(llm, tasks: list[Task], prompt_ids: list[list[int]],
                  params: SamplingParams) -> dict:
    """Decode every task with ``params``; accuracy per family and overall, tokens per forward."""
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    seconds = time.perf_counter() - start
    correct: dict[str, list[int]] = {f: [] for f in dict.fromkeys(t.family for t in tasks)}
    for task, out in zip(tasks, outs):
        correct[task.family].append(int((out.text or "") == task.answer))
    forwards = sum(o.num_forwards for o in outs)
    return {
        "options": dataclasses.asdict(params),
        "accuracy": sum(map(sum, correct.values())) / len(tasks),
        "accuracy_by_family": {f: sum(c) / len(c) for f, c in correct.items()},
        "tokens_per_forward": sum(tokens_decoded(o, params) for o in outs) / forwards,
        "forwards_per_request": forwards / len(tasks),
        "seconds": seconds,
    }


def format_table(results: dict[str, dict]) -> str:
    families = list(next(iter(results.values()))["accuracy_by_family"])
    head = ["mode", "exact", *families, "tok/fwd", "fwd/req"]
    rows = [[name, f"{r['accuracy']:.3f}",
             *(f"{r['accuracy_by_family'][f]:.3f}" for f in families),
             f"{r['tokens_per_forward']:.2f}", f"{r['forwards_per_request']:.2f}"]
            for name, r in results.items()]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in [head, *rows]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from sangam import LLM

    families = tuple(args.families.split(",")) if args.families else DEMO_FAMILIES
    per_family = max(1, args.num_instances // len(families))
    tasks = eval_set(per_family, args.seed, families)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype)
    if llm.tokenizer is None:
        raise SystemExit(f"{args.model}: the checkpoint has no tokenizer; quality needs one")
    # As the model was trained: one user turn plus the assistant header.
    prompt_ids = [llm.loaded.encode_chat([{"role": "user", "content": t.prompt}])
                  for t in tasks]
    modes = [m for m in MODES if not args.modes or m.name in args.modes.split(",")]
    results = {}
    for mode in modes:
        params = SamplingParams(max_tokens=args.max_tokens, block_length=args.block_length,
                                **mode.options)
        results[mode.name] = evaluate_mode(llm, tasks, prompt_ids, params)
        if args.verbose:
            r = results[mode.name]
            print(f"{mode.name}: exact {r['accuracy']:.3f}, {r['tokens_per_forward']:.2f} "
                  f"tokens/forward, {r['seconds']:.1f}s", flush=True)
    print(f"{len(tasks)} held-out instances ({per_family} per family, seed {args.seed}), "
          f"max_tokens {args.max_tokens}, block_length {args.block_length}")
    print(format_table(results))
    if args.json:
        report = {"model": args.model or "demo", "num_instances": len(tasks),
                  "seed": args.seed, "max_tokens": args.max_tokens,
                  "block_length": args.block_length, "modes": results}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "quality", help="exact match and tokens/forward of each decoding mode on held-out tasks",
        description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-instances", type=int, default=240,
                   help="held-out instances in total, split evenly over the families")
    p.add_argument("--families", default=None,
                   help=f"comma-separated subset of {','.join(FAMILIES)} (default: the demo "
                   f"model's, {','.join(DEMO_FAMILIES)})")
    p.add_argument("--modes", default=None,
                   help="comma-separated subset of: " + ",".join(m.name for m in MODES))
    p.add_argument("--seed", type=int, default=EVAL_SEED, help="seed of the held-out instances")
    p.add_argument("--max-tokens", type=int, default=DEMO_MAX_TOKENS)
    p.add_argument("--block-length", type=int, default=DEMO_BLOCK_LENGTH)
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--verbose", action="store_true", help="print each mode as it finishes")
    p.set_defaults(func=run)
