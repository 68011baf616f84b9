"""The prepared GPU check (tools/gpu_check.py) keeps running: its cheap checks, CPU-sized, print a
passing table."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_or_show_where_it_hangs(command: list[str], seconds: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `command` in its own process group; past `seconds`, fail
    with the stack faulthandler dumps on SIGABRT, then kill the group (its ranks too)."""
    options = dict(cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = subprocess.Popen(command, start_new_session=True, **options)
    try:
        stdout, stderr = child.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)  # faulthandler writes the stack, then the process ends
        with contextlib.suppress(ProcessLookupError):  # none of the group left
            os.killpg(child.pid, signal.SIGKILL)
        stderr = child.communicate()[1]
        pytest.fail(f"{command} hung past {seconds} s; its main thread:\n{stderr[-5000:]}")
    return child.returncode, stdout, stderr


def test_the_gpu_check_runs_its_cheap_checks_on_the_cpu():
    checks = ["dropout", "bf16", "gcbs", "precision", "gradients", "nccl", "ddp", "trainer"]
    tool = ["tools/gpu_check.py", "--device", "cpu", "--quick", "--only", *checks]
    # about 40 s on 2 idle cores
    status, stdout, stderr = run_or_show_where_it_hangs(
        [sys.executable, "-X", "faulthandler", *tool], 240
    )
    assert status == 0, stdout + stderr[-3000:]
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| check | result | measured | limit |"
    checks = [line.split(" | ")[0].removeprefix("| ") for line in table[1:]]
    assert [check.split()[0] for check in checks] == [
        "dropout",  # fp32
        "dropout",  # fp64
        "bf16",
        "GCBS",  # the permutation on the device equals the CPU's
        "GCBS",  # its time against one matmul pass
        "trainer,",  # bf16
        "trainer,",  # fp16 with its gradient scaler
        "trainer",  # fp16 gradients, plain backward, against float64
        "trainer",  # through GradCache
        "gloo,",  # the nccl check's stand-in on a CPU
        "gloo,",  # notebook 07's gradient check on 2 ranks
        "trainer,",  # sampler gcbs on 2 ranks with the loader's workers, against one process
    ]
    assert all(line.split(" | ")[1] in ("pass", "info") for line in table[1:])
