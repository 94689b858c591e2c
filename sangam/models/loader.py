"""Loading and saving checkpoints in Hugging Face layout (config.json + *.safetensors)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from sangam.models.checkpoint import read_config
from sangam.models.config import (
    ONLINE_QUANTIZATIONS,
    CheckpointError,
    Fp8Format,
    ModelConfig,
)
from sangam.models.diffusion_gemma import DiffusionGemmaModel
from sangam.models.dream import DreamModel
from sangam.models.llada import LLaDAModel
from sangam.models.llada2 import LLaDA2Model
from sangam.models.llada_moe import LLaDAMoeModel
from sangam.models.quantization import (
    check_scale,
    dequantize_stored,
    fp8_candidates,
    quantize_per_channel,
    use_fp8,
)
from sangam.models.sharding import Cut, ShardLayout, shard_model
from sangam.models.transformer import DiffusionLM, compute_dtype

ARCHITECTURES: dict[str, type[DiffusionLM]] = {
    "LLaDAModelLM": LLaDAModel,
    "DreamModel": DreamModel,
    # Qwen3's tree, Dream's plus q/k norms and a tied head, both read from the config; the
    # block-causal mask is the attention backend's (ModelConfig.causal_block_size).
    "SDARForCausalLM": DreamModel,
    "LLaDA2MoeModelLM": LLaDA2Model,
    # OLMoE's tree, bidirectional like LLaDA; LLaDAMoEModel: the name llama.cpp also accepts.
    "LLaDAMoEModelLM": LLaDAMoeModel,
    "LLaDAMoEModel": LLaDAMoeModel,
    # Gemma-4 layers as a causal encoder and a canvas decoder: uniform-state diffusion.
    "DiffusionGemmaForBlockDiffusion": DiffusionGemmaModel,
}

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """``None``/"auto" -> bfloat16 on GPU, float32 on CPU (docs/design.md §3)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {sorted(DTYPES)}")
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def tensor_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = {name: path / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index} names the shard {f.name}, which is missing")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}")
    files = {}
    for f in shards:
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                files[name] = f
    return files


class _SkipInit(TorchFunctionMode):
    """Inside, ``torch.nn.init`` functions leave their tensor as it is: weights about to be
    loaded need no random init (and ``normal_`` on meta tensors imports torch._dynamo, ~1 s).
    A mode is thread-local, so other threads building modules meanwhile are unaffected."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def dummy_model(config: ModelConfig, device: str | torch.device,
                dtype: torch.dtype, seed: int = 0,
                shard: ShardLayout = ShardLayout()) -> DiffusionLM:
    """The architecture of ``config`` (``shard``'s slice of it) with seeded random weights,
    built straight on ``device`` (no host copy: an 8B model is up in about a second on a GPU).
    Norm weights are 1 and the rest N(0, 0.02): speed does not depend on the values, and such
    a model is never confident, so benchmarks commit a fixed number of tokens per step. On the
    meta device nothing is allocated: what a shard's tensors would weigh, for free."""
    with torch.device("meta"), _SkipInit():
        model = ARCHITECTURES[config.architecture](config).to(dtype)
        if config.quantization is not None:  # every projection that may be FP8 is
            use_fp8(model, set(fp8_candidates(model)), config.quantization)
        cuts = shard_model(model, shard)
    model.weight_cuts = cuts  # what a weight update copies into each parameter
    if torch.device(device).type == "meta":
        return model.eval().requires_grad_(False)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_f." in name:
                p.fill_(1.0)
            elif p.dtype == torch.float8_e4m3fn:  # N(0, 1) values, scaled by 0.02 below
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device))
            elif name.endswith(("_scale", "_scale_inv")):
                p.fill_(0.02)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.prepare()
    return model.eval().requires_grad_(False)


FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None, load_format: str = "auto",
               shard: ShardLayout = ShardLayout(),
               quantization: str | None = None) -> DiffusionLM:
    """Build the architecture named by config.json and load its weights, checking every tensor
    (``load_format="dummy"``: random weights, see :func:`dummy_model`). With a ``shard`` of a
    tensor-parallel group, only that rank's slices are read from the files. An FP8 checkpoint's
    projections load as ``Fp8Linear``s (docs/design.md §6.1); ``quantization="fp8"`` quantizes
    a full-precision checkpoint's at load."""
    path = Path(path)
    config = with_quantization(read_config(path), quantization)
    torch_dtype = resolve_dtype(dtype, device)
    if load_format == "dummy":
        return dummy_model(config, device, torch_dtype, shard=shard)
    with torch.device("meta"), _SkipInit():
        model = ARCHITECTURES[config.architecture](config)
    files = tensor_files(path)
    fmt = config.quantization
    stored_fp8 = _fp8_tensors(files)
    candidates = fp8_candidates(model)
    if fmt is None:
        fp8_names = set()
    elif fmt.method == "online":
        fp8_names = set(candidates)
    else:
        fp8_names = {n for n in candidates if f"{n}.weight" in stored_fp8}
    use_fp8(model, fp8_names, fmt)
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    unscaled = sorted(stored_fp8 & set(expected)) if fmt is None else []
    if unscaled:
        raise CheckpointError(
            f"checkpoint {path} stores {unscaled[0]} (and {len(unscaled) - 1} more) as "
            "float8_e4m3fn, but its config.json has no quantization_config: without their "
            "scales the weights cannot be read")
    full_shapes = dict(expected)
    cuts = shard_model(model, shard)
    made_here = set()  # online scales: computed from the weights, not read
    if fmt is not None and fmt.method == "online":
        made_here = {f"{n}.{fmt.scale_name}" for n in fp8_names}
    # FP8 tensors no FP8 kernel reads (the routed experts): dequantized as they are read.
    widen = {n: _scale_of(n, fmt) for n in stored_fp8 & set(expected)
             if n.removesuffix(".weight") not in fp8_names} if fmt else {}
    missing = sorted(set(expected) - set(files) - made_here
                     | {s for s in widen.values() if s not in files})
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"checkpoint {path} lacks tensors {missing[:5]}{more} required by "
            f"{config.architecture}")
    state = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        if name not in made_here:
            by_file.setdefault(files[name], []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt", device=str(torch.device(device))) as h:
            for name in names:
                shape = tuple(h.get_slice(name).get_shape())
                if shape != full_shapes[name]:
                    raise CheckpointError(
                        f"tensor {name} in {f.name} has shape {list(shape)}, but config.json "
                        f"implies {list(full_shapes[name])}")
                exact = name.endswith(model.full_precision_tensors)
                cut = cuts.get(name)
                module, _, attr = name.rpartition(".")
                if name in widen or (name.endswith(".weight") and module in fp8_names
                                     and fmt.method == "online"):
                    t = h.get_tensor(name)  # whole: its scales span the whole tensor
                else:
                    t = _read(h, name, shape, cut)
                    cut = None
                if name in widen:
                    scale = _read_scale(files[widen[name]], widen[name], device)
                    t = dequantize_stored(t, scale, fmt, compute_dtype(torch_dtype))
                elif module in fp8_names and attr in ("weight", fmt.scale_name, "input_scale"):
                    if attr == "weight" and fmt.method == "online":
                        t, scale = quantize_per_channel(t)
                        state[f"{module}.{fmt.scale_name}"] = _cut(scale, cuts.get(
                            f"{module}.{fmt.scale_name}"))
                    elif attr == "weight" and t.dtype != torch.float8_e4m3fn:
                        raise CheckpointError(f"tensor {name} is {t.dtype}, expected FP8")
                    elif attr != "weight":
                        t = check_scale(name, t)
                    state[name] = _cut(t, cut)
                    continue
                state[name] = _cut(t, cut).to(compute_dtype(torch_dtype) if exact
                                              else torch_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.weight_cuts = cuts  # what a weight update copies into each parameter
    model.prepare()
    return model.eval().requires_grad_(False)


def with_quantization(config: ModelConfig, quantization: str | None) -> ModelConfig:
    """``config`` with ``--quantization``'s format; refused where the checkpoint is quantized
    already or the name is not one of ONLINE_QUANTIZATIONS."""
    if quantization is None:
        return config
    fmt = ONLINE_QUANTIZATIONS.get(quantization)
    if fmt is None:
        raise ValueError(f"quantization must be one of {tuple(ONLINE_QUANTIZATIONS)}, got "
                         f"{quantization!r}")
    if config.quantization == fmt:  # applied already (the front, then the worker)
        return config
    if config.quantization is not None:
        raise CheckpointError(f"--quantization {quantization}: the checkpoint is quantized "
                              f"already ({config.quantization.method}); leave the flag out")
    return dataclasses.replace(config, quantization=fmt)


def _read(h, name: str, shape: tuple[int, ...], cut: Cut | None) -> torch.Tensor:
    """Tensor ``name`` of the open file ``h``: its ``cut`` only, when it has one."""
    if cut is None:
        return h.get_tensor(name)
    return cut.take(h.get_slice(name))  # an expert another rank holds: an empty slice


def _cut(t: torch.Tensor, cut: Cut | None) -> torch.Tensor:
    return t if cut is None else cut.take(t)


def _fp8_tensors(files: dict[str, Path]) -> set[str]:
    """The checkpoint's tensors stored as float8_e4m3fn (read off the files' headers)."""
    out = set()
    for f in set(files.values()):
        with safe_open(f, framework="pt") as h:
            out.update(n for n in h.keys() if h.get_slice(n).get_dtype() == FP8_DTYPE)
    return out


def _scale_of(name: str, fmt: Fp8Format) -> str:
    """The scale tensor of the FP8 tensor ``name``: ``<module>.<scale name>`` beside a
    ``weight``, else ``<name>_scale_inv`` / ``_scale`` (transformers' name for a stacked
    expert parameter)."""
    if name.endswith(".weight"):
        return f"{name[:-len('weight')]}{fmt.scale_name}"
    return f"{name}_{fmt.scale_name.removeprefix('weight_')}"


def _read_scale(f: Path, name: str, device: str | torch.device) -> torch.Tensor:
    with safe_open(f, framework="pt", device=str(torch.device(device))) as h:
        return check_scale(name, h.get_tensor(name))


def save_checkpoint(model: DiffusionLM, raw_config: dict, path: str | os.PathLike,
                    max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (sharded with an index when max_shard_bytes is set)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw_config, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if max_shard_bytes is None:
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
