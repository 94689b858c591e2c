"""The server against its own OpenAPI schema: schemathesis with every check on (schema-valid and
-invalid bodies, every operation, stateful sequences, responses checked against the schema,
auth, methods), on a server with --api-key, within a bounded time, zero failures.

One built-in check is swapped for a stricter one of ours: ``positive_data_acceptance`` allows
any 4xx but 400 for a schema-valid request; ``schema_valid_requests_served``
(tests/schemathesis_hooks.py) demands a 2xx and allows a 400 only for the named rules that JSON
Schema cannot state (fields related to each other, to the model, to the server's flags). A
schema-violating body may also be refused with 413 when it is over the body size limit
(tests/schemathesis.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_serve_openai import serve_subprocess

TESTS = Path(__file__).resolve().parent
BUDGET_S = 120


def test_schemathesis_finds_nothing(chat_ckpt, tmp_path):
    args = ["--model", chat_ckpt, "--device", "cpu", "--served-model-name", "tiny",
            "--api-key", "k", "--max-queue-len", "256", "--log-level", "warning",
            "--max-model-len", "128"]  # generations that take a tiny model a moment
    with serve_subprocess(args, tmp_path / "server.log") as (_, url):
        run = subprocess.run(
            [str(Path(sys.executable).parent / "schemathesis"), "--config-file",
             str(TESTS / "schemathesis.toml"), "run", f"{url}/openapi.json",
             "--checks", "all", "--exclude-checks", "positive_data_acceptance",
             "--max-examples", "30", "--max-time", str(BUDGET_S), "--seed", "1",
             "--request-timeout", "60",
             "-H", "Authorization: Bearer k", "--no-color"],
            cwd=tmp_path, capture_output=True, text=True, timeout=BUDGET_S + 120,
            env={**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
                 "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])})
    report = run.stdout + run.stderr
    (tmp_path / "schemathesis.txt").write_text(report)
    assert run.returncode == 0 and "Tested:" in report, report
