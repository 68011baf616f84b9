"""gcbs_lib.launcher.launch: rank 0's result back, the ranks' output echoed, a failing or stalled
rank surfaced with its traceback, nothing left running. The targets are functions of this module
(children import it by name)."""

import time

import pytest
import torch.distributed as dist
from conftest import child_command_lines

from gcbs_lib.distributed import rank_and_world_size
from gcbs_lib.launcher import LaunchError, launch


def say_hello() -> tuple[int, int]:
    rank, world_size = rank_and_world_size()
    print(f"hello from rank {rank}", flush=True)
    return rank, world_size


def misbehave(how: str) -> None:
    """Rank 1 raises (how="raise") or never arrives (how="stall") while the others wait for it in a
    barrier."""
    if rank_and_world_size()[0] == 1:
        if how == "raise":
            raise RuntimeError("rank 1 failed on purpose")
        time.sleep(3600)
    dist.barrier()


def ranks_left() -> list[list[str]]:
    """The command lines of this process's running children but multiprocessing's resource tracker
    (it lives as long as this process)."""
    return [
        command for command in child_command_lines() if "resource_tracker" not in " ".join(command)
    ]


def test_launch_returns_rank_zeros_result_and_echoes_every_ranks_output(capsys):
    assert launch(say_hello, nproc=3) == (0, 3)
    printed = capsys.readouterr().out
    assert all(f"[rank {r}] hello from rank {r}" in printed for r in range(3))
    assert (
        launch(f"{__name__}:say_hello", nproc=2, echo=False) == (0, 2)
        and capsys.readouterr().out == ""
    )


def test_a_rank_that_raises_is_named_with_its_traceback_and_leaves_no_process():
    start = time.time()
    with pytest.raises(LaunchError) as failure:
        launch(misbehave, nproc=2, args={"how": "raise"}, echo=False)
    assert time.time() - start < 60
    assert failure.value.rank == 1
    assert "Traceback" in str(failure.value) and "RuntimeError: rank 1 failed on purpose" in str(
        failure.value
    )
    assert ranks_left() == []


def test_a_rank_left_waiting_longer_than_the_timeout_fails_and_leaves_no_process():
    start = time.time()
    with pytest.raises(LaunchError, match="Timed out") as failure:
        launch(misbehave, nproc=2, args={"how": "stall"}, timeout=5, echo=False)
    assert time.time() - start < 5 + 30  # the timeout, then starting and stopping the ranks
    assert failure.value.rank == 0  # waiting in the barrier for rank 1
    assert ranks_left() == []
