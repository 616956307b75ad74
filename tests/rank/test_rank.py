"""A rank's choices that only a GPU cluster exercises, shown on CPU through the functions that make them."""

from __future__ import annotations

import pytest

from harness.rank.process import cuda_device_index


@pytest.mark.parametrize(
    ("local_rank", "visible", "expected"),
    [(0, 8, 0), (3, 8, 3), (1, 1, 0), (5, 1, 0), (2, 2, "LOCAL_RANK 2: only 2 GPUs visible"), (0, 0, "no GPU")],
)
def test_a_rank_drives_its_local_rank_or_the_one_gpu_its_task_sees(local_rank: int, visible: int, expected) -> None:
    """Slurm clusters that give each task one GPU through CUDA_VISIBLE_DEVICES leave one visible at
    index 0 whatever LOCAL_RANK says: the raw LOCAL_RANK there is an invalid device ordinal."""
    if isinstance(expected, int):
        assert cuda_device_index(local_rank, visible) == expected
    else:
        with pytest.raises(RuntimeError, match=expected):
            cuda_device_index(local_rank, visible)
