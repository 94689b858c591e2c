"""Loading and saving checkpoints in Hugging Face layout (config.json + *.safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from sangam.models.checkpoint import read_config
from sangam.models.config import CheckpointError, ModelConfig
from sangam.models.diffusion_gemma import DiffusionGemmaModel
from sangam.models.dream import DreamModel
from sangam.models.llada import LLaDAModel
from sangam.models.llada2 import LLaDA2Model
from sangam.models.llada_moe import LLaDAMoeModel
from sangam.models.sharding import ShardLayout, shard_model
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


def _tensor_files(path: Path) -> dict[str, Path]:
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
        shard_model(model, shard)
    if torch.device(device).type == "meta":
        return model.eval().requires_grad_(False)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_f." in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.prepare()
    return model.eval().requires_grad_(False)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None, load_format: str = "auto",
               shard: ShardLayout = ShardLayout()) -> DiffusionLM:
    """Build the architecture named by config.json and load its weights, checking every tensor
    (``load_format="dummy"``: random weights, see :func:`dummy_model`). With a ``shard`` of a
    tensor-parallel group, only that rank's slices are read from the files."""
    path = Path(path)
    config = read_config(path)
    torch_dtype = resolve_dtype(dtype, device)
    if load_format == "dummy":
        return dummy_model(config, device, torch_dtype, shard=shard)
    with torch.device("meta"), _SkipInit():
        model = ARCHITECTURES[config.architecture](config)
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    cuts = shard_model(model, shard)
    files = _tensor_files(path)
    missing = sorted(set(expected) - set(files))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"checkpoint {path} lacks tensors {missing[:5]}{more} required by "
            f"{config.architecture}")
    state = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt", device=str(torch.device(device))) as h:
            for name in names:
                shape = tuple(h.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"tensor {name} in {f.name} has shape {list(shape)}, but config.json "
                        f"implies {list(expected[name])}")
                exact = name.endswith(model.full_precision_tensors)
                cut = cuts.get(name)
                if cut is None:
                    t = h.get_tensor(name)
                elif 0 in cut.shape(shape):  # an expert another rank holds: nothing to read
                    t = torch.empty(cut.shape(shape))
                else:
                    t = cut.take(h.get_slice(name))
                state[name] = t.to(compute_dtype(torch_dtype) if exact else torch_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.prepare()
    return model.eval().requires_grad_(False)


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
