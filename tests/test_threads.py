"""core/threads: the threads a step computes with."""

import os

import pytest
import torch

from fedsim.core.threads import available_cores, scoring_threads, torch_threads


def test_a_step_computes_with_its_threads_and_leaves_them_as_they_were():
    before = torch.get_num_threads()
    with torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(before + 2):
        raise RuntimeError("a failing step")
    assert torch.get_num_threads() == before


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_scoring_uses_every_core_the_process_may_run_on():
    assert available_cores() == len(os.sched_getaffinity(0))
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 leaves it (and the test processes)
    with scoring_threads():
        assert torch.get_num_threads() == available_cores()
    assert torch.get_num_threads() == 1
