"""The prepared GPU run (``microbench/gpu_check.sh``) in its dry-run mode: every step on the CPU
at tiny shapes, with the packages the GPU machine lacks made unimportable, so that a step that
would fail there for a reason a CPU can show fails here first."""

import csv
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_SHARDS = ("tests-attention", "tests-moe", "tests-kernels", "tests-engine")
STEPS = (*TEST_SHARDS, "kernels", "graphs", "nccl-fault", "tp", "weight-nccl", "gemma",
         "gemma-serve", "model", "calibrate", "serve", "sim")


def test_gpu_check_dry_run_runs_every_step(tmp_path):
    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", "microbench/gpu_check.sh", "--dry-run", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert (out / "summary.txt").read_text().split("\n")[:-1] == [f"{s} rc=0" for s in STEPS]
    # The GPU machine's missing packages were missing here too: the plots were skipped.
    assert "matplotlib is not installed" in (out / "serve.log").read_text()
    # DiffusionGemma's demo decoded its held-out tasks.
    gemma = json.loads((out / "gemma.json").read_text())
    assert gemma["num_instances"] == 24 and len(gemma["modes"]) == 1
    # ...and served a trace, canvas by canvas (the GPU run: the 26B-A4B geometry, dummy).
    served = json.loads((out / "gemma-serve" / "results.json").read_text())
    assert served["summaries"][0]["num_requests"] == 8
    # The test lists name tests that exist (a renamed test would be 'not found' on the GPU),
    # and every kernel test file is in one shard.
    logs = {name: (out / f"{name}.log").read_text() for name in TEST_SHARDS}
    for name, log in logs.items():
        assert "no tests ran" not in log and " collected" in log, name
        assert (out / f"{name}.xml").exists(), name
    kernel_files = {f for f in os.listdir(os.path.join(ROOT, "tests"))
                    if f.startswith("test_kernel_")}
    assert {f for f in kernel_files if any(f in log for log in logs.values())} \
        == kernel_files

    calibration = json.loads((out / "calibration.json").read_text())
    assert calibration["geometry"]["layers"] == 2 and calibration["dtype_bytes"] == 4
    assert calibration["complete"] is True
    assert '"skipped": "skip: needs 2 GPUs' in (out / "nccl-fault.log").read_text()
    host, fwd, total = (calibration[k] for k in ("host", "forward_coefficients", "coefficients"))
    assert host["iteration_s"] > 0 and host["per_sequence_s"] >= 0
    assert total["iteration_overhead_s"] == fwd["iteration_overhead_s"] + host["iteration_s"]
    assert total["per_sequence_s"] == fwd["per_sequence_s"] + host["per_sequence_s"]
    serve = json.loads((out / "serve" / "results.json").read_text())
    points = {(s["config"], s["qps"]) for s in serve["summaries"]}
    assert points == {(c, q) for c in ("deficit tau=64", "fastdllm") for q in (8.0, 16.0)}
    with open(out / "serve" / "requests.csv") as f:
        assert len(list(csv.DictReader(f))) == 4 * 6  # every request of every run finished
    profile = json.loads((out / "serve" / "profile.json").read_text())
    assert profile["steps_per_block"] == {"3": profile["steps_per_block"]["3"]}  # 3+3+2 of 8
    sim = json.loads((out / "sim" / "results.json").read_text())
    rows = sim["against"]
    assert {(r["config"], r["qps"]) for r in rows} == points
    for r in rows:  # the simulator ran the serve run's requests, and predicted something
        assert r["same_requests"] is True
        assert 0 < r["mean_ratio"] < 100
