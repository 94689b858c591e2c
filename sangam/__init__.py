"""Sangam: a serving engine for diffusion language models (LLaDA, Dream)."""

from sangam.config import EngineConfig
from sangam.llm import LLM
from sangam.sampling_params import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
