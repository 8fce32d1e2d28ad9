"""The steps of the GPU calls (issue 29): what each runs, its time cap and its guessed time.

Call 1 (at most 300 s) proves the path: the machine, the default experiment through `fedsim run`
with a gate, the CUDA tests, then fedsim against the sequential device-resident loop on W1 and W2
(mnist_cnn). Call 2 (at most 360 s, only after call 1 passed) sets fedsim beside pfl-research on
W3 (pfl first, in its own invocation), W2 with fedavg_cnn, and the language-model memory rows.
Call 3 (at most 540 s, in a session of its own once calls 1 and 2 have run) is ByzFL's
benchmark: fedsim and ByzFL on the same 100-step cells, then fedsim alone on the γ = 0.33 and
γ = 0 rows of ByzFL's grid at their full 800 steps, 12 sweeps at once on the machine's cores.

`guess_s` is a guess for an H100: nothing has measured these steps on a GPU yet. It is printed
beside the measured time and never used to skip a step; a step runs with `cap_s` (or what is left
of the call's budget, if less) as its limit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

# the default experiment must reach this test accuracy after its 3rd round on the GPU (issue 29)
GATE_ACCURACY = 0.92
# --tiny trains on 4,000 MNIST samples on the CPU, which reaches about 0.38 after 3 rounds
TINY_GATE_ACCURACY = 0.30

PROBE = """
import json, os, platform, sys, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "cudnn": torch.backends.cudnn.version(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    a = torch.randn(256, 256, device="cuda")
    info.update(device_name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                memory_gib=round(p.total_memory / 2**30, 1), matmul_ok=bool(torch.isfinite(a @ a).all()),
                peak_after_one_matmul_mb=round(torch.cuda.max_memory_allocated() / 2**20, 1))
print("PROBE " + json.dumps(info))
"""
NVIDIA_QUERY = "name,driver_version,memory.total,memory.used,compute_mode,mig.mode.current,persistence_mode"


@dataclass
class Step:
    """One command of a call. `kind`: env, gate, pytest or bench (a benchmark script's JSON)."""

    name: str
    kind: str
    command: list[str]
    cap_s: float
    guess_s: float
    needs_cuda: bool = False
    workload: str = ""
    model: str = ""
    what: str = ""
    output: str = ""  # where a bench step's script writes its JSON
    extra: dict = field(default_factory=dict)


def bench(name: str, script: str, flags: list[str], cap_s: float, guess_s: float, work: str, **where) -> Step:
    output = f"{work}/{name.replace(' ', '_')}.json"
    command = [sys.executable, f"benchmarks/{script}", *flags, "--output", output]
    return Step(name, "bench", command, cap_s, guess_s, output=output, **where)


def workload_flags(workload: str, model: str, tiny: bool) -> list[str]:
    if not tiny:
        return ["--workload", workload, "--models", model, "--device", "cuda", "--size", "full"]
    # the CPU variants, and for MNIST fewer samples still, so that the dry run takes a few minutes on 2 cores
    fewer = ["--set", "data.limit=3000"] if workload in ("W1", "W2") else []
    return ["--workload", workload, "--models", model, "--device", "cpu", "--size", "cpu", *fewer]


def environment_steps(tiny: bool) -> list[Step]:
    nvidia = ["nvidia-smi", f"--query-gpu={NVIDIA_QUERY}", "--format=csv"]
    return [
        Step("nvidia-smi", "env", nvidia, 20, 2, needs_cuda=True),
        Step("torch probe", "env", [sys.executable, "-c", PROBE], 40, 8),
    ]


def gate_step(tiny: bool, work: str) -> Step:
    command = [sys.executable, "-m", "fedsim", "run", "experiments/mnist_seed.yaml", "--out", f"{work}/gate"]
    command += ["--overwrite"]
    if tiny:
        command += ["--set", "device=cpu", "--set", "data.limit=4000"]
    else:
        command += ["--set", "device=cuda"]
    return Step("gate: fedsim run mnist_seed", "gate", command, 90, 25, extra={"run_dir": f"{work}/gate"})


def call1_steps(tiny: bool, work: str) -> list[Step]:
    """The environment, the gate, the CUDA tests, W1 and W2 (mnist_cnn) against the sequential loop."""
    pytest = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-n", "0", "-p", "no:cacheprovider"]
    pytest += ["-o", "addopts=", "tests/test_cuda.py"]
    w1, w2 = workload_flags("W1", "mnist_cnn", tiny), workload_flags("W2", "mnist_cnn", tiny)
    small = ["--rounds", "2"] if tiny else []
    return [
        *environment_steps(tiny),
        gate_step(tiny, work),
        Step("pytest -m cuda", "pytest", pytest, 150, 75, needs_cuda=True),
        bench("W1 fedsim", "bench_rounds.py", [*w1, *small, "--workers", "2" if tiny else "4"], 70, 35, work,
              workload="W1", model="mnist_cnn", what="fedsim"),
        bench("W1 sequential", "sequential_baseline.py", [*w1, *small], 45, 15, work,
              workload="W1", model="mnist_cnn", what="sequential"),
        bench("W2 fedsim", "bench_rounds.py", [*w2, *small, "--no-cli", "--workers", "1,2" if tiny else "1,4,10"],
              110, 60, work, workload="W2", model="mnist_cnn", what="fedsim"),
        bench("W2 sequential", "sequential_baseline.py", [*w2, "--rounds", "2" if tiny else "3"], 50, 25, work,
              workload="W2", model="mnist_cnn", what="sequential"),
    ]  # fmt: skip


def call2_steps(tiny: bool, work: str) -> list[Step]:
    """pfl-research on W3 first, then fedsim and the sequential loop on W3, W2 with fedavg_cnn, the LM rows."""
    w3, w2 = workload_flags("W3", "pfl_cnn", tiny), workload_flags("W2", "fedavg_cnn", tiny)
    baseline_rounds = ["--rounds", "2" if tiny else "11"]  # medians are over the rounds after the first
    lm = [sys.executable, "benchmarks/bench_lm.py", "--quick", "--device", "cpu" if tiny else "cuda"]
    return [
        *environment_steps(tiny),
        bench("W3 pfl-research", "peer_pfl.py", [*w3, *baseline_rounds, "--procs", "1,2" if tiny else "1,3"],
              130, 80, work, workload="W3", model="pfl_cnn", what="pfl"),
        bench("W3 fedsim", "bench_rounds.py", [*w3, "--no-cli", "--workers", "2" if tiny else "4,8,16"],
              100, 60, work, workload="W3", model="pfl_cnn", what="fedsim"),
        bench("W3 sequential", "sequential_baseline.py", [*w3, *baseline_rounds], 45, 25, work,
              workload="W3", model="pfl_cnn", what="sequential"),
        bench("W2 fedavg_cnn fedsim", "bench_rounds.py",
              [*w2, "--no-cli", *(["--rounds", "2", "--workers", "2"] if tiny else ["--workers", "4,10"])],
              80, 45, work, workload="W2", model="fedavg_cnn", what="fedsim"),
        bench("W2 fedavg_cnn sequential", "sequential_baseline.py", [*w2, "--rounds", "2" if tiny else "3"], 50, 25,
              work, workload="W2", model="fedavg_cnn", what="sequential"),
        # four kinds: the sequential peft loop, a base per worker, the shared base, batched adapters
        Step("LM rows (bench_lm --quick)", "bench", [*lm, "--output", f"{work}/bench_lm.json"], 90, 45,
             output=f"{work}/bench_lm.json", what="lm"),
    ]  # fmt: skip


# the rows of ByzFL's grid not run on a CPU (docs/robustness.md, "What is left"): 144 runs of 800
# steps; cut short, the runs done are kept
GRID = ["--gammas", "1,0.66", "--f", "1,2,3,4", "--rules", "trimmed_mean,geometric_median", "--seeds", "0,1,2"]
TINY_GRID = ["--gammas", "0.33", "--f", "1,2", "--seeds", "0", "--attacks", "sign_flip,optimal_ipm"]


def call3_steps(tiny: bool, work: str) -> list[Step]:
    """ByzFL and fedsim on the same short cells (wall times side by side), then fedsim on the grid."""
    device = ["--device", "cpu" if tiny else "cuda", "--workers", "0"]
    speed = ["--only", "both", "--gammas", "0.33", "--rules", "trimmed_mean", "--seeds", "0", "--byzfl-jobs", "2"]
    speed += ["--steps", "3", "--eval-every", "3", "--f", "1", "--attacks", "sign_flip"] if tiny else ["--f", "1,4"]
    grid_cap = 400
    budget = grid_cap - 45  # then up to 30 s for the sweeps to stop, and the table
    grid = [*(TINY_GRID if tiny else GRID), "--parallel", "2" if tiny else "12", "--budget-s", str(budget)]
    grid += ["--only", "fedsim", *(["--steps", "4", "--eval-every", "2"] if tiny else ["--steps", "800"])]
    return [
        *environment_steps(tiny),
        bench("ByzFL and fedsim, 100 steps", "bench_byzfl.py", [*speed, *device], 110, 60, work, what="byzfl speed"),
        bench("ByzFL grid, fedsim", "bench_byzfl.py", [*grid, *device], grid_cap, 300, work, what="byzfl grid"),
    ]  # fmt: skip
