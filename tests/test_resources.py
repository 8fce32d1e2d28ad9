"""execution/resources: what a run asks of the operating system."""

import subprocess
import sys

import pytest

from fedsim.execution import resources

# A fresh process frees a tensor of 100 MB and prints how much of it its resident set still holds
FREED = """
import os, torch
from fedsim.execution.resources import keep_freed_memory
if {keep}:
    keep_freed_memory()
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
tensor = torch.ones(25 * 2**20)  # 100 MB, written
before = resident()
del tensor
print((resident() - before + 100 * 2**20) / 2**20)
"""


def resident_after_freeing(keep: bool) -> float:
    done = subprocess.run([sys.executable, "-c", FREED.format(keep=keep)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_freed_block_stays_with_the_process_for_the_next():
    assert resident_after_freeing(keep=False) < 10  # glibc handed the 100 MB back at once
    assert resident_after_freeing(keep=True) > 90  # kept, for the next stack of updates


def test_a_setting_in_the_environment_is_left_as_it_is(monkeypatch):
    calls = []

    class Libc:
        def mallopt(self, parameter, value):
            calls.append((parameter, value))

    monkeypatch.setattr(resources.ctypes, "CDLL", lambda name: Libc())
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    resources.keep_freed_memory()
    assert calls == [(resources.M_MMAP_THRESHOLD, 1 << 30), (resources.M_TRIM_THRESHOLD, 1 << 30)]
    calls.clear()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    resources.keep_freed_memory()
    assert calls == []


def test_without_glibc_nothing_is_asked(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(resources.ctypes, "CDLL", missing)
    resources.keep_freed_memory()  # no error: the allocator is left as it is
