"""CpuThreads: --threads as given, else the cores other processes leave free."""

import pytest
import torch

from expertstream.config import EngineConfig
from expertstream.runtime import cpu_threads
from expertstream.runtime.cpu_threads import CpuThreads


@pytest.fixture
def restore_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_fixed_threads_are_kept_and_set_torch(restore_torch_threads):
    t = CpuThreads(3)
    assert t() == 3 and torch.get_num_threads() == 3
    with pytest.raises(ValueError, match="threads"):
        CpuThreads(-1)
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(threads=-2)


@pytest.mark.parametrize("others, want", [(0.0, 4), (0.3, 4), (1.0, 3), (1.5, 2), (2.7, 1), (9.0, 1)])
def test_auto_threads_leave_the_cores_others_keep_busy(others, want, monkeypatch, restore_torch_threads):
    monkeypatch.setattr(cpu_threads, "allowed_cores", lambda: 4)
    t = CpuThreads(0, period=0.0)
    assert t() in (1, 2, 3, 4)
    monkeypatch.setattr(t, "others", lambda: others)
    assert t() == want and torch.get_num_threads() == want


def test_others_busy_time_is_measured_on_linux(restore_torch_threads):
    t = CpuThreads(0, period=0.0)
    x = 0
    for i in range(200_000):  # our own busy time must not count as another process's
        x += i
    others = t.others()
    assert others is None or others >= 0.0
