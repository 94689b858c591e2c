"""Write an lm-eval task of the demo model's held-out instances (the ones ``sangam-bench
quality`` decodes, same seed and count) to a directory, for ``lm-eval --include_path DIR``.

    python scripts/lmeval/make_task.py DIR [--num-instances 240]

The task is ``sangam_demo``: generate_until, the user message as the prompt (the chat template
is applied by lm-eval, ``--apply_chat_template``, or by the server for chat completions), exact
match of the answer. No dataset is downloaded: the instances are a local JSON Lines file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sangam.demo import DEMO_MAX_TOKENS
from sangam.demo.tasks import DEMO_FAMILIES, EVAL_SEED, eval_set

TASK = """task: sangam_demo
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: {max_tokens}
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--num-instances", type=int, default=240)
    p.add_argument("--seed", type=int, default=EVAL_SEED)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = eval_set(max(1, args.num_instances // len(DEMO_FAMILIES)), args.seed, DEMO_FAMILIES)
    data = args.out / "sangam_demo.jsonl"
    data.write_text("".join(json.dumps({"family": t.family, "prompt": t.prompt,
                                        "answer": t.answer}) + "\n" for t in tasks))
    (args.out / "sangam_demo.yaml").write_text(
        TASK.format(data=data.resolve(), max_tokens=DEMO_MAX_TOKENS))
    print(f"{len(tasks)} instances: {args.out / 'sangam_demo.yaml'}")


if __name__ == "__main__":
    main()
