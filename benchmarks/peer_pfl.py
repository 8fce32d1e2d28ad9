"""pfl-research (the `pfl` package 0.6.0, PyTorch backend) on workload W3, timed as fedsim is.

    python benchmarks/peer_pfl.py --procs 1,3,5                        # GPU-sized W3
    python benchmarks/peer_pfl.py --size cpu --device cpu --procs 1,2 --rounds 3

Runs pfl in its own interpreter (this one by default, `--python` to name another); pfl must be
importable there (benchmarks/gpu_wheelhouse.sh brings its wheels to a machine without network).
The run is W3 as fedsim runs it: the same clients (fedsim.experiment.federation: the data, its partition,
the initial weights of `pfl_cnn`), pfl's own FederatedAveraging with a SimulatedBackend, the
users as in-memory pfl Datasets, a fresh local SGD (lr 0.1, batch 10, 1 epoch), central SGD with
lr 1 (plain averaging), 50 users a round, pfl's CentralEvaluationCallback every 10 rounds in
batches of 10,000, as pfl-research's CIFAR-10 benchmark sets it. For each `--procs` N it starts N
ranks sharing the device (pfl's multi-process mode through PFL_WORKER_ADDRESSES and
PFL_WORKER_RANK; pfl's guide finds 1 to 5 processes per GPU best, "try 1, 2, 3, ... and stop once
you don't see any noticeable speedups"). pfl 0.6.0 picks NCCL whenever CUDA is there, and NCCL
refuses two ranks on one GPU, so ranks sharing a GPU talk through gloo (`--dist-backend`).

Rank 0 records a time stamp after every round; the results JSON holds the same fields as
bench_rounds.py's (`round_seconds`, `client_updates_per_second`, `startup_seconds`,
`wall_seconds`, ...), from launch to exit as a user would time it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

SCRIPT = Path(__file__).resolve()
COLUMNS = [
    ("workload", "workload", ""),
    ("model", "model", ""),
    ("procs", "procs", "d"),
    ("round1 s", "round1_seconds", ".3f"),
    ("s/round", "round_seconds", ".3f"),
    ("mean s/round", "mean_round_seconds", ".3f"),
    ("updates/s", "client_updates_per_second", ",.1f"),
    ("startup s", "startup_seconds", ".2f"),
    ("wall s", "wall_seconds", ".2f"),
    ("acc", "final_test_accuracy", ".4f"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_workload_arguments(parser)
    parser.set_defaults(workload="W3", models="pfl_cnn")
    parser.add_argument("--procs", default="1", help="processes sharing the device, comma-separated (default 1)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that has pfl (default this one)")
    parser.add_argument("--dist-backend", default="gloo", help="torch.distributed backend of ranks sharing a GPU")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- in each rank


def rank_main(spec: dict) -> None:
    """One pfl process. Environment: PFL_WORKER_RANK / PFL_WORKER_ADDRESSES when there are several."""
    t_start = time.time()
    import torch

    world = int(spec["procs"])
    if world > 1 and spec["device"] == "cuda":
        _force_backend(torch, spec["dist_backend"])
    if spec["device"] == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import MinimizeReuseUserSampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module
    from pfl.model.pytorch import PyTorchModel

    from fedsim.experiment.federation import initial_model, load_federation
    from fedsim.experiment.validation import load_config

    cfg = load_config(spec["config"], spec["overrides"])
    rank = get_default_framework_module().distributed.global_rank
    torch.manual_seed(cfg.seed)
    federation = load_federation(cfg)  # fedsim's start: the data, the clients, the initial weights
    data, parts = federation.data, federation.parts
    device = torch.device("cuda" if spec["device"] == "cuda" else "cpu")
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    users = {user: [train_x[part.to(device)], train_y[part.to(device)]] for user, part in enumerate(parts)}
    order = list(torch.randperm(len(parts), generator=torch.Generator().manual_seed(cfg.seed)).tolist())
    train_data = FederatedDataset.from_slices(users, MinimizeReuseUserSampler(order))
    test_data = Dataset(raw_data=[data.test_x.to(device), data.test_y.to(device)])

    net = with_pfl_methods(initial_model(cfg, data))
    model = PyTorchModel(
        model=net, local_optimizer_create=torch.optim.SGD, central_optimizer=torch.optim.SGD(net.parameters(), 1.0)
    )
    eval_params = NNEvalHyperParams(local_batch_size=cfg.eval_batch_size)
    clock = round_clock(cfg.clients_per_round)
    callbacks = [CentralEvaluationCallback(test_data, model_eval_params=eval_params, frequency=cfg.eval_every), clock]
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=cfg.rounds,
        evaluation_frequency=cfg.eval_every,
        train_cohort_size=cfg.clients_per_round,
        val_cohort_size=0,
    )
    train_params = NNTrainHyperParams(
        local_learning_rate=cfg.local.lr, local_num_epochs=cfg.local.epochs, local_batch_size=cfg.local.batch_size
    )
    FederatedAveraging().run(
        algorithm_params=algorithm_params,
        backend=SimulatedBackend(train_data, None),
        model=model,
        model_train_params=train_params,
        model_eval_params=eval_params,
        callbacks=callbacks,
        send_metrics_to_platform=False,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    if rank == 0:
        Path(spec["result"]).write_text(
            json.dumps(
                {
                    "t_start": t_start,
                    "t_train_begin": clock.t0,
                    "rows": clock.rows,
                    "t_end": time.time(),
                    "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
                }
            )
        )


def _force_backend(torch, backend: str) -> None:
    """Make pfl's init_process_group use ``backend`` (it asks for NCCL on any CUDA machine)."""
    original = torch.distributed.init_process_group

    def init_process_group(*args, **kwargs):
        kwargs["backend"] = backend
        return original(*args[1:] if args else (), **kwargs)

    torch.distributed.init_process_group = init_process_group


def with_pfl_methods(net):
    """The `loss` and `metrics` methods that pfl's PyTorchModel calls, as pfl-research's own CNN has."""
    import types

    import torch
    import torch.nn.functional as F
    from pfl.metrics import Weighted

    def loss(self, x, y, eval=False):
        self.eval() if eval else self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x, y, eval=True):
        self.eval() if eval else self.train()
        out = self(x)
        return {
            "loss": Weighted(F.cross_entropy(out, y, reduction="sum").item(), len(x)),
            "accuracy": Weighted((out.argmax(1) == y).sum().item(), len(x)),
        }

    net.loss, net.metrics = types.MethodType(loss, net), types.MethodType(metrics, net)
    return net


def round_clock(clients: int):
    """The last callback: a time stamp and the central accuracy (when evaluated) after every round."""
    import torch
    from pfl.callback.base import TrainingProcessCallback
    from pfl.metrics import Metrics

    class RoundClock(TrainingProcessCallback):
        def __init__(self):
            self.rows = []

        def on_train_begin(self, *, model):
            self.t0 = self.last = time.time()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.time()
            accuracy = aggregate_metrics.to_simple_dict().get("Central val | accuracy")
            self.rows.append(
                {
                    "round": central_iteration + 1,
                    "seconds": now - self.last,
                    "elapsed_seconds": now - self.t0,
                    "clients": clients,
                    "test_accuracy": accuracy,
                    "train_seconds": now - self.last,
                    "aggregate_seconds": 0.0,
                    "eval_seconds": 0.0,
                }
            )
            self.last = now
            return False, Metrics()

    return RoundClock()


# ----------------------------------------------------------------------------- the launcher


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def measure_one(args, run: dict, procs: int, device: str) -> dict:
    """N ranks of pfl, from launch to the last exit; the memory of the launcher's process tree."""
    entry = {
        "workload": run["workload"],
        "model": run["model"],
        "tool": "pfl",
        "procs": procs,
        "overrides": run["overrides"],
    }
    print(f"{run['workload']} {run['model']} pfl procs={procs} ...", end=" ", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "config": run["config"],
            "overrides": run["overrides"],
            "procs": procs,
            "device": device,
            "dist_backend": args.dist_backend,
            "result": str(Path(tmp) / "rank0.json"),
        }
        env = harness.child_env()
        env["PFL_PYTORCH_DEVICE"] = "cuda" if device == "cuda" else "cpu"
        addresses = ",".join(f"localhost:{port}" for port in free_ports(procs))
        sampler = harness.MemorySampler(gpu=device == "cuda")
        start = time.time()
        sampler.start(os.getpid())
        ranks = []
        for rank in range(procs):
            rank_env = {**env, "PFL_WORKER_RANK": str(rank), "PFL_WORKER_ADDRESSES": addresses} if procs > 1 else env
            with open(Path(tmp) / f"rank{rank}.log", "w") as log:
                ranks.append(
                    subprocess.Popen(
                        [args.python, str(SCRIPT), "--rank-spec", json.dumps(spec)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=rank_env,
                    )
                )
        codes = [process.wait() for process in ranks]
        wall = time.time() - start
        sampler.stop()
        result_path = Path(spec["result"])
        if any(codes) or not result_path.is_file():
            lines = [line for line in (Path(tmp) / "rank0.log").read_text().splitlines() if line.strip()]
            entry.update(status="failed", message=lines[-1] if lines else f"exit statuses {codes}")
            print("failed", flush=True)
            return entry
        result = json.loads(result_path.read_text())
    rows = result["rows"]
    entry.update(
        status="ok",
        **harness.round_statistics(rows, 0.0),
        rows=rows,
        wall_seconds=wall,
        startup_seconds=result["t_train_begin"] - start,
        final_test_accuracy=_last_accuracy(rows),
        device_name=result["device_name"],
        torch=result["torch"],
        threads=result["threads"],
        peak_mb=result["peak_memory_mb"],
        **harness.memory_fields(sampler.report()),
    )
    entry.pop("samples_per_second", None)
    print(f"{entry.get('round_seconds') or 0:.3f} s/round", flush=True)
    return entry


def _last_accuracy(rows: list[dict]):
    return next((r["test_accuracy"] for r in reversed(rows) if r["test_accuracy"] is not None), None)


def measure_all(args, device: str) -> list[dict]:
    return [
        measure_one(args, run, int(procs), device)
        for run in harness.workload_runs(args)
        for procs in harness.split_list(args.procs)
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_spec:
        rank_main(json.loads(args.rank_spec))
        return 0
    device, machine = harness.resolved_device(args.device), harness.machine_info()
    return harness.report_entries(
        "peer_pfl",
        "pfl-research (medians over rounds 2.., mean s/round and updates/s over rounds 2.. with evaluations)",
        COLUMNS,
        args,
        device,
        machine,
        measure_all(args, device),
        what=lambda e: f"{e['workload']} pfl procs={e['procs']}",
    )


if __name__ == "__main__":
    sys.exit(main())
