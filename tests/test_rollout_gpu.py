"""RL rollouts on a GPU (docs/design.md §3.1): in bf16 with CUDA graphs, a weight update in place
leaves the captured graphs valid, and a memory release and resume (the graphs captured again)
changes no token. microbench/gpu_check.sh runs it; its imports are only what the GPU machine
has."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_cases import PARAMS, PROMPTS, perturbed, state

from sangam import LLM
from sangam.testing import make_tiny_checkpoint


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_updates_and_memory_on_cuda(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base", arch="llada", seed=3)
    new = perturbed(base, tmp_path / "new", seed=1)
    gpu = dict(device="cuda", dtype="bfloat16", cuda_graph_block_lengths="4,8")
    params = [dataclasses.replace(p, temperature=0.0) for p in PARAMS]

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS,
                                                  sampling_params=params)]

    want = tokens(LLM(new, **gpu))
    llm = LLM(base, **gpu)
    assert llm.engine.runner.graphs  # captured
    tokens(llm)
    llm.update_weights_from_tensor(state(new))
    assert tokens(llm) == want
    free = torch.cuda.mem_get_info()[0]
    llm.release_memory_occupation()
    assert torch.cuda.mem_get_info()[0] > free  # given back
    llm.resume_memory_occupation()
    assert tokens(llm) == want
