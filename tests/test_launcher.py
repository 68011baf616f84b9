"""gcbs_lib.distributed.launch: rank 0's result back, a failing or stalled rank surfaced fast, nothing left behind."""
import time

import psutil
import pytest

from gcbs_lib.distributed import LaunchError, launch, rank_and_world_size


def job_processes(target: str, since: float) -> list[psutil.Process]:
    """Processes of launched jobs running `target` that started after `since` (torchrun and its workers)."""
    found = []
    for process in psutil.process_iter(["cmdline", "create_time"]):
        command = " ".join(process.info["cmdline"] or [])
        if "gcbs_lib.distributed" in command and target in command and process.info["create_time"] >= since - 1:
            found.append(process)
    return found


def test_launch_returns_rank_zeros_result():
    assert launch(rank_and_world_size, nproc=3, timeout=120, echo=False) == [0, 3]


def test_a_rank_that_raises_surfaces_its_traceback_quickly_and_leaves_no_process():
    start = time.time()
    with pytest.raises(LaunchError) as failure:
        launch("gcbs_lib.ddp_experiments:misbehave", nproc=2, args={"rank": 1, "how": "raise"}, timeout=120,
               echo=False)
    assert time.time() - start < 60
    assert failure.value.rank == 1 and failure.value.returncode not in (0, None)
    assert "Traceback" in str(failure.value) and "rank 1 failed on purpose" in str(failure.value)
    assert job_processes("misbehave", start) == []


def test_a_stalled_rank_is_stopped_at_the_timeout_and_leaves_no_process():
    start = time.time()
    with pytest.raises(LaunchError, match="did not finish within 10 s") as failure:
        launch("gcbs_lib.ddp_experiments:misbehave", nproc=2, args={"rank": 1, "how": "stall"}, timeout=10, echo=False)
    assert time.time() - start < 10 + 15  # the timeout, then at most two grace periods to stop everything
    assert failure.value.returncode is None
    assert job_processes("misbehave", start) == []
