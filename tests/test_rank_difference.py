"""Specification of `rank_difference` on 2 gloo ranks: the largest difference in any entry, NaN
where any rank holds a NaN, and a clear error on every rank when the ranks' tensors differ in size
or dtype."""

import math

import pytest
import torch
import torch.distributed as dist

from gcbs_lib.distributed import rank_and_world_size, rank_difference
from gcbs_lib.launcher import launch


def rank_tensors(rank: int) -> list[torch.Tensor]:
    """Seeded float32, float64, empty and float16 tensors; rank 1 holds them nudged in one entry
    each."""
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(7, 5, generator=g),
        torch.randn(13, generator=g, dtype=torch.float64),
        torch.zeros(0),
        torch.randn(3, 4, generator=g).half(),
    ]
    if rank == 1:
        tensors[0][2, 3] += 0.25
        tensors[1][-1] -= 0.5
        tensors[3][1, 1] += 1.0
    return tensors


def raised_on(function, *args) -> tuple[int, str]:
    """On how many ranks `function` raised a ValueError, and this rank's message."""
    try:
        function(*args)
        message = ""
    except ValueError as error:
        message = str(error)
    count = torch.tensor(int(bool(message)))
    dist.all_reduce(count)
    return int(count), message


def checks() -> dict:
    """On every rank (a `launch` target): the rank difference of `rank_tensors`, of identical
    tensors, of NaNs and infinities, and the errors of ranks holding different sizes or dtypes."""
    rank, _ = rank_and_world_size()
    same = rank_tensors(0)
    return {
        "difference": rank_difference(rank_tensors(rank)),
        "identical": rank_difference(same),
        "empty": rank_difference([]),
        "nan_on": [
            rank_difference([torch.tensor([1.0, math.nan if rank == r else 2.0])]) for r in (0, 1)
        ],
        "same_infinity": rank_difference([torch.tensor([math.inf, 1.0 + rank])]),
        "sizes": raised_on(rank_difference, [*same, torch.zeros(rank + 1)]),
        "dtypes": raised_on(
            rank_difference, [t.double() if rank and t.dtype == torch.float32 else t for t in same]
        ),
    }


@pytest.fixture(scope="module")
def job():
    return launch(checks, nproc=2, echo=False)


def test_the_difference_is_the_largest_in_any_entry(job):
    expected = float(
        torch.cat(
            [
                (a.double() - b.double()).abs().reshape(-1)
                for a, b in zip(rank_tensors(0), rank_tensors(1))
            ]
        ).max()
    )
    assert expected == pytest.approx(1.0, abs=1e-2)  # the float16 entry's nudge is the largest
    assert job["difference"] == expected


def test_identical_tensors_and_no_tensors_differ_by_zero(job):
    assert job["identical"] == 0.0 and job["empty"] == 0.0


def test_a_nan_on_any_rank_gives_nan_and_the_same_infinity_on_every_rank_does_not_count(job):
    # gloo's MAX and MIN alone would drop rank 1's NaN
    assert all(math.isnan(d) for d in job["nan_on"])
    assert job["same_infinity"] == 1.0


def test_ranks_holding_different_sizes_or_dtypes_all_raise(job):
    for case in ("sizes", "dtypes"):
        assert job[case][0] == 2 and "different sizes or dtypes" in job[case][1], case


def test_one_process_has_nothing_to_compare():
    assert rank_difference(rank_tensors(0)) == 0.0
