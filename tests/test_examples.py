"""The scripts in examples/ run as the README says and print what they promise."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPECTED = {  # script -> fragments of its output
    "generate_tiny.py": ["cache=dual", "cache=prefix", "cache=none"],
    # The demo model: a stream per task, one output per block of 4; "z" stops "hazel".
    "async_stream.py": ["-> 'magn'", "-> 'magnas'", "-> 'ha' ", "stop"],
}


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "examples").glob("*.py")))
def test_example_runs(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, f"examples/{script}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for fragment in EXPECTED[script]:
        assert fragment in proc.stdout, (fragment, proc.stdout)
