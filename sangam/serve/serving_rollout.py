"""The RL-rollout routes (docs/design.md §3.1), SGLang's names and bodies: weight updates in
place, the weights version, the prefix cache's flush, memory release and resume, and pausing
generation. Behind the API key like every route; each waits for the requests in flight (they
finish on the old weights) and answers ``{"success": true, "message", "weight_version"}``, or
400 with why it was refused (the engine serves on unchanged).

``/update_weights_from_tensor`` takes the tensors as one safetensors file, base64-encoded
(SGLang sends pickled tensors, which a server must never unpickle from a client).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable
from typing import Annotated, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from sangam.engine.async_engine import AsyncEngine, EngineDead
from sangam.engine.weight_group import BACKENDS
from sangam.engine.worker_control import MEMORY_TAGS
from sangam.models.weight_update import UPDATE_DTYPE_NAMES
from sangam.serve.errors import ApiError
from sangam.serve.openapi import errors
from sangam.serve.protocol import RequestBody

MAX_UPDATE_TENSORS = 100_000  # tensors in one update (an MoE checkpoint's ~20k, with room)
MAX_TENSOR_DIMS = 8
MAX_DIM = 2**31 - 1

TensorName = Annotated[str, Field(min_length=1, max_length=1024)]
Dim = Annotated[int, Field(ge=0, le=MAX_DIM)]


class UpdateWeightsFromDiskRequest(RequestBody):
    model_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_format: Literal["auto"] | None = None  # SGLang's field: safetensors is the format


class UpdateWeightsFromTensorRequest(RequestBody):
    # One safetensors file of {name: full tensor}, base64 (the body limit bounds it).
    serialized_named_tensors: Annotated[str, Field(min_length=1)]


class InitWeightsUpdateGroupRequest(RequestBody):
    master_address: Annotated[str, Field(min_length=1, max_length=255)]
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2, le=65536)
    group_name: Annotated[str, Field(min_length=1, max_length=255)] = "weight_update_group"
    backend: Literal[BACKENDS] | None = None


class UpdateWeightsFromDistributedRequest(RequestBody):
    names: Annotated[list[TensorName], Field(min_length=1, max_length=MAX_UPDATE_TENSORS)]
    dtypes: Annotated[list[Literal[tuple(UPDATE_DTYPE_NAMES)]],
                      Field(min_length=1, max_length=MAX_UPDATE_TENSORS)]
    shapes: Annotated[list[Annotated[list[Dim], Field(max_length=MAX_TENSOR_DIMS)]],
                      Field(min_length=1, max_length=MAX_UPDATE_TENSORS)]


class MemoryRequest(RequestBody):
    tags: Annotated[list[Literal[MEMORY_TAGS]], Field(min_length=1)] | None = None


class RolloutResponse(BaseModel):
    success: bool = True
    message: str = ""
    weight_version: int  # after the operation


class WeightVersion(BaseModel):
    weight_version: int


class PauseResponse(RolloutResponse):
    num_aborted: int = 0  # requests in flight that the pause ended ("abort")


def add_rollout_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """Add the routes to ``app``."""
    route_errors = errors(400, 503)

    async def run(op: Awaitable, what: str) -> RolloutResponse:
        try:
            await op
        except EngineDead as e:
            raise ApiError(503, str(e), "server_error", code="engine_dead") from None
        except (ValueError, RuntimeError) as e:  # refused: the engine is as it was
            raise ApiError(400, f"{what}: {e}") from None
        return RolloutResponse(message=what, weight_version=engine.weights_version)

    @app.get("/get_weight_version")
    async def get_weight_version() -> WeightVersion:
        return WeightVersion(weight_version=engine.weights_version)

    @app.post("/update_weights_from_disk", responses=route_errors)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> RolloutResponse:
        return await run(engine.update_weights_from_disk(body.model_path), "weights updated")

    @app.post("/update_weights_from_tensor", responses=route_errors)
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest
                                         ) -> RolloutResponse:
        try:
            named = load_safetensors(base64.b64decode(body.serialized_named_tensors,
                                                      validate=True))
        except (binascii.Error, SafetensorError, ValueError) as e:
            raise ApiError(400, "serialized_named_tensors must be a safetensors file, base64: "
                                f"{e}") from None
        return await run(engine.update_weights_from_tensor(named), "weights updated")

    @app.post("/init_weights_update_group", responses=route_errors)
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest
                                        ) -> RolloutResponse:
        return await run(engine.init_weights_update_group(
            body.master_address, body.master_port, body.rank_offset, body.world_size,
            body.group_name, body.backend), "joined the weight-update group")

    @app.post("/update_weights_from_distributed", responses=route_errors)
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest
                                              ) -> RolloutResponse:
        return await run(engine.update_weights_from_distributed(body.names, body.dtypes,
                                                                body.shapes),
                         "weights updated")

    @app.post("/flush_cache", responses=route_errors)
    async def flush_cache() -> RolloutResponse:
        return await run(engine.flush_cache(), "cache flushed")

    @app.post("/release_memory_occupation", responses=route_errors)
    async def release_memory_occupation(body: MemoryRequest | None = None) -> RolloutResponse:
        return await run(engine.release_memory_occupation(body and body.tags),
                         "memory released")

    @app.post("/resume_memory_occupation", responses=route_errors)
    async def resume_memory_occupation(body: MemoryRequest | None = None) -> RolloutResponse:
        return await run(engine.resume_memory_occupation(body and body.tags),
                         "memory resumed")

    @app.post("/pause_generation", responses=route_errors)
    async def pause_generation() -> PauseResponse:
        n = await engine.pause_generation()
        return PauseResponse(message="generation paused", weight_version=engine.weights_version,
                             num_aborted=n)

    @app.post("/continue_generation", responses=route_errors)
    async def continue_generation() -> RolloutResponse:
        return await run(engine.continue_generation(), "generation continued")
