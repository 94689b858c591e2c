"""BatchUploader: one staging buffer, one copy, typed views that outlive later uploads."""

import warnings

import numpy as np
import pytest
import torch

from sangam.engine.device_batch import BatchUploader


def _arrays(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "ids": rng.integers(0, 1 << 40, n),  # int64
        "cu": np.arange(n + 1, dtype=np.int32),
        "table": rng.integers(0, 99, (n, 3)).astype(np.int32),
        "temp": rng.random(n),  # float64
        "logit_scale": rng.random(n).astype(np.float32),
        "empty": np.zeros(0, dtype=np.int64),
        "odd": np.arange(3, dtype=np.int32)[::-1],  # not contiguous
    }


def _check(got: dict[str, torch.Tensor], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, a in want.items():
        t = got[name]
        assert t.shape == a.shape and t.numpy().dtype == a.dtype, name
        assert t.data_ptr() % 16 == 0, name
        np.testing.assert_array_equal(t.numpy(), a, err_msg=name)


def test_round_trip_and_views_outlive_later_uploads():
    up = BatchUploader("cpu")
    first_in = _arrays(5, seed=0)
    first = up.upload(first_in)
    _check(first, first_in)
    # A larger batch grows the staging buffer, a smaller one reuses it; neither may change what
    # an earlier upload returned (the forward of that iteration may still be reading it).
    for n, seed in ((40, 1), (2, 2)):
        arrays = _arrays(n, seed)
        _check(up.upload(arrays), arrays)
        _check(first, first_in)
    assert up.copies == 3


def test_rejects_dtypes_it_cannot_view():
    with pytest.raises(TypeError, match="flags"):
        BatchUploader("cpu").upload({"flags": np.zeros(3, dtype=bool)})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_upload_is_one_copy_from_pinned_staging():
    up = BatchUploader("cuda")
    for n, seed in ((5, 0), (64, 1), (3, 2)):
        arrays = _arrays(n, seed)
        got = up.upload(arrays)
        assert all(t.is_cuda and t.data_ptr() % 16 == 0 for t in got.values())
        _check({k: v.cpu() for k, v in got.items()}, arrays)
    assert up.copies == 3 and up._staging.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_iteration_synchronizes_only_to_read_its_scores(llada_path):
    """Everything a forward and its unmasking read is uploaded before the forward is enqueued,
    so the CPU never waits for the GPU mid-iteration: the only synchronizing operations are
    the two reads of tokens and confidences at its end (graph and eager iterations alike)."""
    from sangam import LLM
    from sangam.sampling_params import SamplingParams

    llm = LLM(model=llada_path, device="cuda", dtype="float32", num_pages=512,
              max_batch_size=8)  # four graph buckets: quick to capture
    runner = llm.engine.runner
    execute, syncs = runner.execute, []

    def counted(*args, **kwargs):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return execute(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs.append(sum("synchroniz" in str(w.message) for w in caught))

    runner.execute = counted
    params = SamplingParams(max_tokens=64, block_length=32, cache="dual")
    llm.generate(prompt_token_ids=[[5] * 20, [7] * 40, [9] * 3], sampling_params=params)
    assert runner.graphs and runner.graphs[0].runs > 0
    assert syncs and set(syncs) == {2}, syncs
    llm.shutdown()
