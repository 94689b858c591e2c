"""FP8 linear layers (docs/design.md §6.1): the module that holds an FP8 weight and its scales
under the checkpoint's tensor names (``Fp8Linear``), which of a model's projections become
one, and quantizing a weight at load (``--quantization fp8``).

A checkpoint says which layers are FP8 by its tensors' dtypes: a projection whose ``weight``
is stored as float8_e4m3fn runs as an ``Fp8Linear`` (the LM head and the embedding never do);
a mixture of experts stacks its FP8 experts' weights and scales for ``fused_moe``'s FP8 form.
FP8 tensors that are no projection's (DiffusionGemma's 3-D expert parameters) are
dequantized at load into the model's dtype: exact values, full-precision memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sangam.kernels.fp8_gemm import fp8_linear
from sangam.kernels.platform import compiled
from sangam.kernels.reference import FP8_GROUP, FP8_MAX, dequantize_fp8_ref, fp8_linear_ref
from sangam.models.config import CheckpointError, Fp8Format

Gemm = Callable[..., torch.Tensor]


class Fp8Linear(nn.Module):
    """``y = x W^T (+ b)`` with W stored in FP8: ``weight`` (float8_e4m3fn ``[N, K]``), its
    scale under the format's name (``weight_scale_inv`` / ``weight_scale``: ``[ceil(N/128),
    ceil(K/128)]`` per block, ``[N, 1]`` per channel, ``[1]`` per tensor) and, with static
    activations, ``input_scale`` ``[1]``. Runs the Triton kernel where launches compile (a
    GPU), its reference elsewhere; ``gemm`` overrides the choice (tests)."""

    gemm: Gemm | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: Fp8Format):
        super().__init__()
        self.fmt = fmt
        self.weight = nn.Parameter(torch.empty(out_features, in_features,
                                               dtype=torch.float8_e4m3fn), requires_grad=False)
        self.register_parameter(fmt.scale_name, nn.Parameter(
            torch.empty(scale_shape(fmt, out_features, in_features)), requires_grad=False))
        if fmt.activations == "static":
            self.input_scale = nn.Parameter(torch.empty(1), requires_grad=False)
        else:
            self.input_scale = None
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def scale(self) -> torch.Tensor:
        """The weight's scales, under whichever name the format gives them."""
        return self._parameters[self.fmt.scale_name]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8={self.fmt.weights}/{self.fmt.activations}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemm = self.gemm or (fp8_linear if compiled(x.device) else fp8_linear_ref)
        scale = self.scale
        block = self.fmt.weights == "block"
        if not block:  # one scale per output channel, the kernel's epilogue layout
            scale = scale.reshape(-1).expand(self.out_features)
        return gemm(x, self.weight, scale, activation=self.fmt.activations,
                    input_scale=self.input_scale, block_weights=block, bias=self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W in ``dtype`` (what the kernels multiply by, up to the activations' rounding)."""
        return dequantize_fp8_ref(self.weight, self.scale, dtype,
                                  self.fmt.weights == "block")


def scale_shape(fmt: Fp8Format, out_features: int, in_features: int) -> tuple[int, ...]:
    if fmt.weights == "block":
        return -(-out_features // FP8_GROUP), -(-in_features // FP8_GROUP)
    return (out_features, 1) if fmt.weights == "channel" else (1,)


def fp8_candidates(model: nn.Module) -> dict[str, nn.Linear]:
    """The projections that may run in FP8, by module name: every ``nn.Linear`` but the LM
    head (routed experts included: the fused MoE kernel has an FP8 form)."""
    head = model.output_head()
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head}


def use_fp8(model: nn.Module, names: set[str], fmt: Fp8Format) -> None:
    """Replace the projections ``names`` of ``model`` (on the meta device, before sharding and
    loading) by ``Fp8Linear``s of ``fmt`` of the same shape."""
    for name in sorted(names):
        linear = model.get_submodule(name)
        owner, _, attr = name.rpartition(".")
        with torch.device("meta"):
            fp8 = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, fmt)
        setattr(model.get_submodule(owner) if owner else model, attr, fp8)
    model.__dict__.pop("_parts", None)  # LayerParts name modules: make them anew


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[N, K]`` as FP8 with one fp32 scale per output channel (``[N, 1]``): each
    row's amax maps to FP8_MAX (``--quantization fp8``, vLLM's online FP8)."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_stored(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
                      dtype: torch.dtype) -> torch.Tensor:
    """A stored FP8 tensor that runs in ``dtype`` (an expert's: no FP8 kernel reads it), with
    its scales: per 128 x 128 block over its last two dims, else per channel or tensor."""
    return dequantize_fp8_ref(weight, scale, dtype, fmt.weights == "block")


def check_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` in fp32, refused unless finite and non-negative (a NaN scale is a layer of
    NaNs). UE8M0 scales (powers of two) convert exactly."""
    s = scale.to(torch.float32)
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise CheckpointError(f"FP8 scale {name} holds non-finite or negative values")
    return s
