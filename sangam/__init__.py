"""Sangam: a serving engine for diffusion language models (LLaDA, Dream, SDAR, LLaDA2.x,
LLaDA-MoE).

``LLM`` is imported when first used: the policy core (``sangam.sched``) and the request types
import without PyTorch.
"""

from typing import TYPE_CHECKING

from sangam.config import EngineConfig
from sangam.sampling_params import CompletionOutput, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from sangam.llm import LLM, WeightUpdateGroup

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams",
           "WeightUpdateGroup"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name == "LLM":
        from sangam.llm import LLM

        return LLM
    if name == "WeightUpdateGroup":  # a trainer's end of init_weights_update_group
        from sangam.llm import WeightUpdateGroup

        return WeightUpdateGroup
    raise AttributeError(f"module 'sangam' has no attribute {name!r}")
