"""EngineConfig: validation on construction and one CLI flag per field."""

import argparse
import dataclasses
import math

import pytest

from sangam.config import EngineConfig


def test_every_field_is_a_flag_and_round_trips():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args([
        "--model", "/m", "--device", "cpu", "--dtype", "float64", "--token-budget", "inf",
        "--policy", "prefill_first", "--page-size", "32", "--num-pages", "100",
        "--max-batch-size", "8", "--mode", "hybrid", "--prefill-workers", "2",
        "--decode-workers", "1", "--overflow-threshold", "64", "--layerwise-kv-streaming"])
    cfg = EngineConfig.from_cli_args(args)
    assert cfg.token_budget == math.inf and cfg.scheduler.budget == math.inf
    assert (cfg.page_size, cfg.num_pages, cfg.max_batch_size) == (32, 100, 8)
    assert cfg.mode == "hybrid" and cfg.layerwise_kv_streaming and cfg.is_multi_worker
    flags = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= flags
    assert EngineConfig.from_cli_args(parser.parse_args([])) == EngineConfig()


def test_vllm_flag_spellings_are_aliases():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    cfg = EngineConfig.from_cli_args(parser.parse_args(
        ["--max-num-seqs", "12", "--gpu-memory-utilization", "0.5"]))
    assert (cfg.max_batch_size, cfg.gpu_memory_fraction) == (12, 0.5)


@pytest.mark.parametrize("bad,match", [
    (dict(page_size=12), "power of two"), (dict(policy="fifo"), "policy must be one of"),
    (dict(token_budget=0), "token_budget"), (dict(device="tpu"), "device"),
    (dict(mode="ring"), "mode must be"), (dict(nnodes=2), "dist_init_addr"),
    (dict(node_rank=1), "node_rank"), (dict(node_ip="10.0.0.2"), "node_ip"),
    (dict(nnodes=2, dist_init_addr="h:1", node_ip="10.0.0"), "node_ip"),
    (dict(network_interface="eth0"), "network_interface"),
    (dict(distributed_executor_backend="ray", device="cuda:1"), "device index"),
    (dict(distributed_executor_backend="ray", nnodes=2, dist_init_addr="h:1"), "ray"),
    (dict(heartbeat_timeout=0.5), "heartbeat_timeout"),
    (dict(gpu_memory_fraction=1.5), "gpu_memory_fraction"),
])
def test_invalid_configs_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_sangam_serve_takes_the_model_positionally():
    from sangam.cli import parse_args

    assert parse_args(["serve", "/ckpt", "--port", "9"]).model == "/ckpt"
    assert parse_args(["serve", "--model", "/ckpt"]).model == "/ckpt"
    assert parse_args(["serve", "/ckpt", "--model", "/ckpt"]).model == "/ckpt"
    assert parse_args(["serve"]).model is None  # the demo model
    with pytest.raises(SystemExit):
        parse_args(["serve", "/a", "--model", "/b"])


def test_every_attention_backend_has_a_row_of_the_kernel_table():
    """``--attention-backend`` names the row of the one table that picks Triton kernels or
    their references (models/kernel_table.py)."""
    from sangam.config import ATTENTION_BACKENDS
    from sangam.models.kernel_table import KERNEL_TABLE

    assert set(ATTENTION_BACKENDS) == set(KERNEL_TABLE)
    assert all(row.name == name for name, row in KERNEL_TABLE.items())
