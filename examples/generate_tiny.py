"""Generate with a tiny random checkpoint (no weights needed): python examples/generate_tiny.py"""

import tempfile

from sangam import LLM, SamplingParams
from sangam.testing import make_tiny_checkpoint

with tempfile.TemporaryDirectory() as path:
    make_tiny_checkpoint(path, arch="dream", num_heads=8, num_kv_heads=2)
    llm = LLM(path, device="cpu", dtype="float64")
    for cache in ("dual", "prefix", "none"):
        params = SamplingParams(max_tokens=32, block_length=8, cache=cache, stop_at_eos=False)
        out = llm.generate(prompt_token_ids=[[3, 14, 15, 92, 65]], sampling_params=params)[0]
        print(f"cache={cache:6s} forwards={out.num_forwards:2d} tokens={out.token_ids}")
