"""The scripts in examples/ run as the README says and print what they promise."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNS = [  # (script, its arguments, fragments of its output)
    ("generate_tiny.py", [], ["cache=dual", "cache=prefix", "cache=none"]),
    # The demo model: a stream per task, one output per block of 4; "z" stops "hazel".
    ("async_stream.py", [], ["-> 'magn'", "-> 'magnas'", "-> 'ha' ", "stop"]),
    # GRPO: rollouts in process, then by a two-worker deployment; the weights pushed each step
    # and the trainer's recomputed log-probabilities the rollout's (float32 rounding).
    ("grpo.py", [], ["step 3: reward", "weights version 3", "logprob| <= "]),
    ("grpo.py", ["--num-workers", "2", "--steps", "2", "--prompts", "4", "--samples", "4"],
     ["step 2: reward", "weights version 2"]),
]


def test_every_example_runs():
    assert {p.name for p in (REPO / "examples").glob("*.py")} == {s for s, _, _ in RUNS}


@pytest.mark.parametrize("script,args,expected", RUNS,
                         ids=[" ".join([s, *a]) for s, a, _ in RUNS])
def test_example_runs(script, args, expected):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for fragment in expected:
        assert fragment in proc.stdout, (fragment, proc.stdout)
    if script == "grpo.py":  # the on-policy check: the rollout's log-probs, recomputed
        gaps = [float(line.rsplit("<= ", 1)[1].split()[0].rstrip(","))
                for line in proc.stdout.splitlines() if "logprob| <= " in line]
        assert gaps and max(gaps) < 1e-4, proc.stdout
