"""A tiny model decodes the same tokens with the Triton attention backend as with PyTorch's.

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1): float64 must match
token for token, float32 on nearly all tokens. On CUDA, float32 and bf16 agreement is checked.
"""

from __future__ import annotations

import os

import pytest
import torch

from sangam.decoding import DecodeState
from sangam.engine.reference_decoder import ReferenceDecoder
from sangam.engine.scoring import FusedScorer
from sangam.models import TorchAttentionBackend, load_model
from sangam.models.triton_attention import TritonAttentionBackend
from sangam.sampling_params import SamplingParams
from sangam.testing import make_tiny_checkpoint

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_CPU = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")
_GPU = [pytest.mark.gpu, pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(),
                                             reason="needs CUDA (not interpreted)")]
# (device, dtype, minimum fraction of identical tokens)
EXACT = [pytest.param("cpu", "float64", 1.0, marks=_CPU, id="cpu-fp64")]
CLOSE = [
    pytest.param("cpu", "float32", 0.9, marks=_CPU, id="cpu-fp32"),
    pytest.param("cuda", "float32", 0.9, marks=_GPU, id="cuda-fp32"),
    pytest.param("cuda", "bfloat16", 0.6, marks=_GPU, id="cuda-bf16"),
]
ARCHS = {"llada": {}, "dream": {"num_heads": 8, "num_kv_heads": 2}}
# (cache, rule, temperature, tokens_per_step)
MODES = [("dual", "threshold", 0.0, 1), ("prefix", "factor", 0.0, 1), ("none", "topk", 0.7, 2)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny fp64 matmuls are 100x slower when torch's threads contend with a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch=arch, seed=3, **kw)
            for arch, kw in ARCHS.items()}


def _decode(model, backend, params, prompt):
    model.attention_backend = backend
    cfg = model.config
    state = DecodeState(prompt, params, cfg.mask_token_id, frozenset({cfg.eos_token_id}),
                        cfg.shift_logits, seed=7)
    ReferenceDecoder(model).run(state)
    return state.output_token_ids(), state.num_forwards


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("device,dtype,min_agree,mode", [
    *[pytest.param(*p.values, m, marks=p.marks, id=f"{p.id}-{m[0]}") for p in EXACT
      for m in MODES],
    *[pytest.param(*p.values, MODES[0], marks=p.marks, id=p.id) for p in CLOSE],
])
def test_triton_backend_decodes_like_torch(checkpoints, arch, device, dtype, min_agree, mode):
    cache, rule, temperature, per_step = mode
    model = load_model(checkpoints[arch], device, dtype)
    params = SamplingParams(max_tokens=16, block_length=8, cache=cache, unmasking=rule,
                            temperature=temperature, tokens_per_step=per_step,
                            stop_at_eos=False)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    want, want_forwards = _decode(model, TorchAttentionBackend(), params, prompt)
    got, got_forwards = _decode(model, TritonAttentionBackend(), params, prompt)
    assert len(got) == len(want) == 16
    agree = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    if min_agree == 1.0:
        assert got == want and got_forwards == want_forwards
    else:
        assert agree >= min_agree, f"only {agree:.0%} of tokens agree"


@_CPU
@pytest.mark.parametrize("arch", list(ARCHS))
def test_llm_triton_backend_matches_reference_backend(checkpoints, arch):
    """The whole engine path: packed batch, Triton attention, fused unmasking kernel."""
    from sangam import LLM

    prompts = [[5, 6, 7], list(range(10, 29)), [42] * 9, [8, 9], [11, 12, 13], [20, 21, 22, 23]]
    params = [SamplingParams(max_tokens=12, block_length=4, cache=cache, unmasking=rule,
                             temperature=temp, tokens_per_step=k, seed=i, stop_at_eos=False)
              for i, (cache, rule, temp, k) in enumerate(MODES)]
    # Nucleus sampling, logit_bias, penalties, min_tokens, alternatives: the fused kernel's rows
    # of these are scored again.
    params.append(SamplingParams(max_tokens=12, block_length=4, temperature=1.5, top_p=0.6,
                                 top_k=5, min_p=0.05, seed=3, stop_at_eos=False))
    params.append(SamplingParams(max_tokens=12, block_length=4, logit_bias={7: 2.0, 9: -100},
                                 stop_at_eos=False))
    params.append(SamplingParams(max_tokens=12, block_length=4, frequency_penalty=1.5,
                                 repetition_penalty=2.0, min_tokens=6, seed=4, logprobs=2))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    inputs[1]["suffix_token_ids"] = [60, 61, 62, 63, 64]  # infilling: attention reaches it
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(checkpoints[arch], device="cpu", dtype="float64", attention_backend=backend,
                  page_size=4, num_pages=64)
        assert isinstance(llm.engine.runner.scorer, FusedScorer) == (backend == "triton")
        outs[backend] = [(o.token_ids, o.num_forwards,
                          o.top_logprobs and [[t for t, _ in alt] for alt in o.top_logprobs])
                         for o in llm.generate(inputs, params)]
        # Every input of a forward, the unmasking parameters included, in one upload.
        assert llm.engine.runner.uploader.copies == len(llm.engine.stats.iterations) > 0
    assert outs["triton"] == outs["torch"]


@_CPU
def test_attention_is_planned_once_per_forward(checkpoints, monkeypatch):
    """Tiles, splits and the tile -> request map are the same in every layer: one plan per
    forward, not one per layer."""
    import sangam.models.triton_attention as ta

    plans, plan = [], ta.plan_attention

    def counting_plan(*args, **kwargs):
        plans.append(1)
        return plan(*args, **kwargs)

    monkeypatch.setattr(ta, "plan_attention", counting_plan)
    model = load_model(checkpoints["llada"], "cpu", "float64")
    assert model.config.num_layers > 1
    params = SamplingParams(max_tokens=8, block_length=8, cache="none", unmasking="topk",
                            tokens_per_step=4, stop_at_eos=False)
    _, forwards = _decode(model, TritonAttentionBackend(), params, [5, 6, 7])
    assert len(plans) == forwards == 2
