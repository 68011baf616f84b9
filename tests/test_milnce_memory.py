"""Specification of `loss_peak_memory` on CPU: each setting is measured in a fresh process of its own, so no
setting can reuse (or be charged for) pages an earlier one left resident."""
import subprocess

from gcbs_lib.experiments.milnce import loss_peak_memory


def test_each_setting_is_probed_in_a_fresh_process_of_its_own(monkeypatch):
    commands, real_run = [], subprocess.run

    def recorded_run(command, *args, **kwargs):
        commands.append(command)
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", recorded_run)
    full, chunked = (dict(clips=256, bag_size=4, dim=16, chunk_size=c, direction="both") for c in (None, 64))
    peaks = loss_peak_memory([full, chunked, full])
    assert len(commands) == 3 and len(set(map(tuple, commands))) == 2  # one process per setting
    assert all(peak > 0 for peak in peaks)
    assert peaks[1] < min(peaks[0], peaks[2]) / 2, "the chunked loss needs far less than the full one"
