"""What every engine offers its callers (docs/design.md §3), whatever its shape: the in-process
``Engine``, the multi-worker ``MultiWorkerEngine`` and ``AsyncEngine`` (either of those in a
background thread). Callers hold one of these and never ask which engine it is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sangam.config import EngineConfig
    from sangam.engine.front import EngineStats
    from sangam.engine.loaded_model import LoadedModel
    from sangam.sampling_params import RequestOutput, SamplingParams

Gauge = tuple[str, str, float]  # (metric name, help, value now)


@runtime_checkable
class EngineClient(Protocol):
    """An engine as a server or a benchmark sees it: its configuration, its model (tokenizer,
    request defaults), its statistics, its live gauges, and its end. Requests go through
    ``SteppedEngine`` (add, abort, step) or ``AsyncEngine`` (``generate``, ``abort``)."""

    config: EngineConfig
    loaded: LoadedModel
    profilable: bool  # its forwards run in this process, where torch.profiler can see them

    @property
    def stats(self) -> EngineStats: ...

    def describe(self) -> str:
        """One line on what serves."""

    def gauges(self) -> list[Gauge]:
        """Every live gauge (requests in flight, the KV pools, ...), read now."""

    def shutdown(self) -> None: ...


@runtime_checkable
class SteppedEngine(EngineClient, Protocol):
    """An engine its caller steps (``LLM`` in its own thread, ``AsyncEngine`` in a background
    one): ``Engine`` and ``MultiWorkerEngine``."""

    requests: Mapping[str, object]  # the requests in flight, by id

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None,
                    suffix_token_ids: list[int] = ()) -> None: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def step(self) -> list[RequestOutput]: ...

    def watch(self) -> None:
        """While nothing is in flight (no ``step``): notice what happened to the workers now,
        not at the next request. Raises as ``step`` does when none can serve."""

    def has_unfinished_requests(self) -> bool: ...

    # Weights, cache and memory (docs/design.md §3.1), between requests.
    weights_version: int

    def update_weights_from_tensor(self, named_tensors) -> int: ...

    def update_weights_from_disk(self, model_path) -> int: ...

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = ..., backend: str | None = None
                                  ) -> None: ...

    def update_weights_from_distributed(self, names, dtypes, shapes) -> int: ...

    def flush_cache(self) -> None: ...

    def release_memory_occupation(self, tags=None) -> None: ...

    def resume_memory_occupation(self, tags=None) -> None: ...
