"""gcbs_lib.launcher.launch: rank 0's result back, the ranks' output echoed, a failing rank
surfaced with its traceback, a stalled one within the collective timeout, nothing left running.
The targets are functions of this module (children import it by name)."""

import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import child_command_lines

from gcbs_lib.distributed import rank_and_world_size
from gcbs_lib.launcher import COLLECTIVE_TIMEOUT, LaunchError, collective_timeout, launch


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


@pytest.mark.parametrize("given", ["argument", "environment"])
def test_a_rank_left_waiting_longer_than_the_timeout_fails_and_leaves_no_process(
    monkeypatch, given
):
    """The timeout given to `launch`, or else GCBS_COLLECTIVE_TIMEOUT's, bounds a frozen rank."""
    timeout = {"timeout": 5} if given == "argument" else {}
    monkeypatch.setenv("GCBS_COLLECTIVE_TIMEOUT", "5" if given == "environment" else "3600")
    start = time.time()
    with pytest.raises(LaunchError, match="Timed out") as failure:
        launch(misbehave, nproc=2, args={"how": "stall"}, echo=False, **timeout)
    # the timeout, then starting and stopping the ranks (slow on a busy machine): far below 30 min
    assert time.time() - start < 5 + 120
    assert failure.value.rank == 0  # waiting in the barrier for rank 1
    assert ranks_left() == []


def test_the_collective_timeout_is_the_given_seconds_else_the_environments_else_30_minutes(
    monkeypatch,
):
    monkeypatch.delenv("GCBS_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout() == timedelta(minutes=30) == timedelta(seconds=COLLECTIVE_TIMEOUT)
    monkeypatch.setenv("GCBS_COLLECTIVE_TIMEOUT", "90")
    assert collective_timeout() == timedelta(seconds=90)
    assert collective_timeout(2.5) == timedelta(seconds=2.5)


@pytest.mark.parametrize(
    "environment, seconds, message",
    [
        ("ten", None, "GCBS_COLLECTIVE_TIMEOUT must be seconds, got 'ten'"),
        ("0", None, "a collective timeout must be positive seconds, got 0.0"),
        ("-5", None, "a collective timeout must be positive seconds, got -5.0"),
        ("inf", None, "a collective timeout must be positive seconds, got inf"),
        ("nan", None, "a collective timeout must be positive seconds, got nan"),
        ("90", 0, "a collective timeout must be positive seconds, got 0"),
    ],
)
def test_a_timeout_that_is_not_positive_seconds_is_refused_before_any_rank_starts(
    monkeypatch, environment, seconds, message
):
    monkeypatch.setenv("GCBS_COLLECTIVE_TIMEOUT", environment)
    with pytest.raises(ValueError, match=message):
        launch(say_hello, nproc=2, timeout=seconds, echo=False)
    assert ranks_left() == []
