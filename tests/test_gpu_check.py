"""The prepared GPU check (tools/gpu_check.py) keeps running: its cheap checks, CPU-sized, print a
passing table."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_its_cheap_checks_on_the_cpu():
    checks = ["dropout", "bf16", "gcbs", "precision", "gradients", "nccl", "ddp", "trainer"]
    done = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--device", "cpu", "--quick", "--only", *checks],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
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
