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


@pytest.mark.parametrize(
    "chosen, expected",
    [
        ({}, "10000 None"),
        ({"GOMP_SPINCOUNT": "INFINITY"}, "INFINITY None"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "None ACTIVE"),
    ],
)
def test_a_waiting_openmp_thread_spins_briefly_unless_told_otherwise(chosen, expected):
    """Set when fedsim is imported, before torch loads its OpenMP runtime; the worker processes
    inherit it. A spin count or a wait policy in the environment is kept (a policy sets its own count)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = (
        "import os, sys, fedsim; get = os.environ.get; "
        "print(get('GOMP_SPINCOUNT'), get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], env={**env, **chosen}, capture_output=True, text=True)
    assert done.stdout.split() == [*expected.split(), "False"], done.stderr
