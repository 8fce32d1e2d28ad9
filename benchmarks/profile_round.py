"""Profile local training and the server's round work with torch.profiler.

    python benchmarks/profile_round.py --workload W2 --models fedavg_cnn
    python benchmarks/profile_round.py --size cpu --device cpu --trace

In a fresh process, set up as a worker is (one CPU thread, or the CUDA device), and from the
run's own start (fedsim.experiment.federation: its clients and initial weights), a
fedsim.execution.client.LocalTrainer on a fedsim.core.flat.FlatModel trains a few clients of round 1 on the
device-resident data: first one client to warm up, then the clients timed without the
profiler, then the same clients under the profiler (CPU and, on a GPU, CUDA activity). The
server's part of a round follows: updates against the global weights, the aggregation rule
and server optimizer of the config, and fedsim's test-set evaluation.

Prints the wall time per client and per SGD step, a breakdown of the profiled client time
(forward, backward, SGD step, data gather, weight load, host syncs) and the top operators by
self time; writes JSON and the full profiler tables to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import harness

SCRIPT = Path(__file__).resolve()

# How the operators directly inside a client's range are grouped. The forward pass is one
# range (opened by module hooks); the loss is computed outside the module.
FORWARD_OPS = {"fedsim::forward", "aten::cross_entropy_loss"}
SGD_OPS = {"aten::add_", "aten::mul_", "aten::zero_", "aten::detach"}  # step, momentum, grad zero, loss sum
GATHER_OPS = {"aten::randperm", "aten::index", "aten::split", "aten::slice", "aten::select"}
SYNC_OPS = {"aten::item", "aten::_local_scalar_dense"}
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
CATEGORIES = ("forward", "backward", "SGD step", "data gather", "weight load", "host sync", "other")

BREAKDOWN_COLUMNS = [
    ("part", "part", ""),
    ("calls", "calls", ",d"),
    ("host ms", "host_ms", ",.1f"),
    ("host %", "host_share", ".1%"),
]
DEVICE_COLUMNS = [("device ms", "device_ms", ",.1f"), ("device %", "device_share", ".1%")]
TIMING_COLUMNS = [
    ("workload", "workload", ""),
    ("model", "model", ""),
    ("device", "device", ""),
    ("clients", "clients", "d"),
    ("steps/client", "steps_per_client", "d"),
    ("s/client", "client_seconds", ".3f"),
    ("ms/step", "step_ms", ".2f"),
    ("aggregate s", "aggregate_seconds", ".4f"),
    ("evaluate s", "evaluate_seconds", ".3f"),
    ("syncs/client", "syncs_per_client", ".1f"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_workload_arguments(parser)
    parser.add_argument("--clients", type=int, default=3, help="clients to time and profile (default 3)")
    parser.add_argument("--trace", action="store_true", help="also write a Chrome trace (chrome://tracing, Perfetto)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- in the child


class Setup:
    """One client-training worker and the server of a round, built as fedsim builds them."""

    def __init__(self, spec: dict):
        import numpy as np
        import torch

        from fedsim.algorithms.local import LocalTrainer
        from fedsim.core.flat import FlatModel
        from fedsim.core.streams import client_seed
        from fedsim.data.augment import augmentation_for
        from fedsim.experiment import components
        from fedsim.experiment.federation import initial_model, load_federation
        from fedsim.experiment.validation import load_config
        from fedsim.fl.sampling import draw
        from fedsim.runs.parts import resolve_device

        cfg = self.cfg = load_config(spec["config"], spec["overrides"])
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        federation = load_federation(cfg)  # what the run starts from: its clients, then its initial weights
        data, parts = federation.data, federation.parts
        self.server_model = FlatModel(initial_model(cfg, data), self.device)
        self.worker_model = FlatModel(
            components.build_model(cfg.model, data.input_shape, data.num_classes), self.device
        )
        self.test_x, self.test_y = data.test_x.to(self.device), data.test_y.to(self.device)
        self.trainer = LocalTrainer(
            self.worker_model,
            data.train_x.to(self.device),
            data.train_y.to(self.device),
            cfg.local,
            num_classes=data.num_classes,
            augment=augmentation_for(cfg.data, data.input_shape),
        )
        everyone = np.arange(cfg.data.num_clients)  # a uniform sample, every client online
        round_clients = draw("uniform", cfg.seed, 1, everyone, cfg.clients_per_round, None).tolist()
        self.clients = round_clients[: spec["clients"]]
        self.indices = {c: parts[c].to(self.device) for c in self.clients}
        self.seeds = {c: client_seed(cfg.seed, 1, c) for c in self.clients}
        self.start = self.server_model.flat.clone()
        self.steps = cfg.local.epochs * math.ceil(len(parts[self.clients[0]]) / cfg.local.batch_size)

    def train(self, client: int):
        """Train one client from the global weights; a copy of its weights."""
        self.trainer.train(self.indices[client], self.start, self.seeds[client])
        return self.worker_model.flat.clone()

    def evaluate(self) -> None:
        from fedsim.engine.loop import evaluate

        evaluate(self.server_model.module, self.test_x, self.test_y, self.cfg.eval_batch_size)

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, work) -> tuple[float, object]:
        self.sync()
        start = time.perf_counter()
        result = work()
        self.sync()
        return time.perf_counter() - start, result


@contextmanager
def as_worker(device):
    """Inside, torch uses one CPU thread, as a CPU worker does; the server keeps torch's default."""
    import torch

    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure(spec: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    setup = Setup(spec)
    cuda = setup.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with as_worker(setup.device):
        setup.train(setup.clients[0])  # warm-up: first kernels, cuDNN algorithm choice, allocator
        timings = [setup.timed(lambda c=client: setup.train(c)) for client in setup.clients]
        hooks = annotate_forward(setup.worker_model.module, record_function)
        with profile(activities=activities) as worker_prof:
            for client in setup.clients:
                with record_function("fedsim::client"):
                    setup.train(client)
            setup.sync()
        for hook in hooks:
            hook.remove()

    server_round = make_server_round(setup, [weights for _, weights in timings])
    server_round()  # warm-up
    aggregate_seconds, _ = setup.timed(server_round)
    evaluate_seconds, _ = setup.timed(setup.evaluate)
    with profile(activities=activities) as server_prof:  # a session of its own: worker and server tables stay apart
        with record_function("fedsim::aggregate"):
            server_round()
            setup.sync()
        with record_function("fedsim::evaluate"):
            setup.evaluate()
    if spec.get("trace"):
        worker_prof.export_chrome_trace(spec["trace"].replace(".trace", "-worker.trace"))
        server_prof.export_chrome_trace(spec["trace"].replace(".trace", "-server.trace"))

    breakdown, syncs = client_breakdown(worker_prof.events(), cuda)
    client_seconds = [seconds for seconds, _ in timings]
    mean_client = sum(client_seconds) / len(client_seconds)
    return {
        "device": str(setup.device),
        "device_name": torch.cuda.get_device_name(setup.device) if cuda else "cpu",
        "torch": torch.__version__,
        "clients": len(setup.clients),
        "client_ids": setup.clients,
        "client_seconds_each": client_seconds,
        "client_seconds": mean_client,
        "steps_per_client": setup.steps,
        "step_ms": 1000 * mean_client / setup.steps,
        "aggregate_seconds": aggregate_seconds,
        "evaluate_seconds": evaluate_seconds,
        "syncs_per_client": syncs / len(setup.clients),
        "breakdown": breakdown,
        "top_ops": {"worker": top_ops(worker_prof, cuda), "server": top_ops(server_prof, cuda)},
        "tables": {"worker": profiler_tables(worker_prof, cuda), "server": profiler_tables(server_prof, cuda)},
    }


def make_server_round(setup: Setup, trained: list):
    """The server's work between the two barriers of a round, as fedsim's round loop does it:
    updates = client weights - global weights, a finiteness check, the aggregation rule, the
    server optimizer step, and the weighted train loss read back to the host. The ``k`` rows
    of a round are the trained clients' weights, repeated."""
    import torch

    from fedsim.experiment import components
    from fedsim.fl.server_opt import make_server_optimizer

    cfg, model, device = setup.cfg, setup.server_model, setup.device
    k, n = cfg.clients_per_round, model.num_params
    local = torch.stack([trained[i % len(trained)] for i in range(k)])  # [k, P] as the shared buffer holds it
    sizes = [len(setup.indices[c]) for c in setup.clients]
    counts = torch.tensor([sizes[i % len(sizes)] for i in range(k)], dtype=torch.float32, device=device)
    losses = torch.ones(k, device=device)
    rule = components.aggregator(cfg.aggregator, cfg.aggregator_options)
    optimizer = make_server_optimizer(cfg, n, device)

    def server_round():
        model.flat.copy_(setup.start)  # every call aggregates the same round
        updates = local - model.flat
        keep = torch.isfinite(updates).all(dim=1).nonzero().flatten()
        delta = rule(updates[keep], counts[keep])
        optimizer.step(model.params, delta[:n])
        model.flat[n:].add_(delta[n:])
        float((counts[keep] * losses[keep]).sum() / counts[keep].sum())

    return server_round


def annotate_forward(module, record_function) -> list:
    """Module hooks that put each forward pass in a 'fedsim::forward' profiler range."""
    open_ranges = []

    def before(*_):
        open_ranges.append(record_function("fedsim::forward").__enter__())

    def after(*_):
        open_ranges.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def category(name: str) -> str:
    if name in FORWARD_OPS:
        return "forward"
    if name.startswith("autograd::") or name == "aten::ones_like":  # ones_like seeds the backward pass
        return "backward"
    if name in SGD_OPS:
        return "SGD step"
    if name in GATHER_OPS:
        return "data gather"
    if name == "aten::copy_":
        return "weight load"
    if name in SYNC_OPS:
        return "host sync"
    return "other"


def client_breakdown(events, cuda: bool) -> tuple[list[dict], int]:
    """Time of the operators directly inside the client ranges, by category; and the number
    of host syncs inside them. On a GPU the backward pass runs on autograd's own thread, so
    its top-level operators count too."""
    totals = {name: {"part": name, "calls": 0, "host_ms": 0.0, "device_ms": 0.0} for name in CATEGORIES}
    syncs = 0
    for e in events:
        if not str(e.device_type).endswith("CPU"):
            continue
        parent = e.cpu_parent
        inside_client = parent is not None and parent.name == "fedsim::client"
        backward_thread = parent is None and e.name.startswith("autograd::")
        if inside_client or backward_thread:
            part = totals[category(e.name)]
            part["calls"] += 1
            part["host_ms"] += e.cpu_time_total / 1000
            part["device_ms"] += e.device_time_total / 1000
        if (e.name in SYNC_CALLS or (not cuda and e.name in SYNC_OPS)) and _within(e, "fedsim::client"):
            syncs += 1
    rows = list(totals.values())
    host, device = sum(r["host_ms"] for r in rows), sum(r["device_ms"] for r in rows)
    for r in rows:
        r["host_share"] = r["host_ms"] / host if host else None
        r["device_share"] = r["device_ms"] / device if device else None
    return rows, syncs


def _within(event, range_name: str) -> bool:
    while event is not None:
        if event.name == range_name:
            return True
        event = event.cpu_parent
    return False


def top_ops(prof, cuda: bool, limit: int = 25) -> dict:
    averages = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)
    ops = [
        {
            "name": a.key,
            "calls": a.count,
            "self_cpu_ms": a.self_cpu_time_total / 1000,
            "cpu_total_ms": a.cpu_time_total / 1000,
            "self_device_ms": a.self_device_time_total / 1000,
            "device_total_ms": a.device_time_total / 1000,
        }
        for a in averages
    ]
    by_device = sorted(ops, key=lambda o: o["self_device_ms"], reverse=True) if cuda else []
    return {"by_self_cpu": ops[:limit], "by_self_device": by_device[:limit]}


def profiler_tables(prof, cuda: bool) -> str:
    averages = prof.key_averages()
    text = "by self CPU time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=40)
    if cuda:
        text += "\n\nby self CUDA time\n" + averages.table(sort_by="self_device_time_total", row_limit=40)
    return text


# ----------------------------------------------------------------------------- in the parent


def top_lines(table: str, rows: int) -> str:
    """The heading and first ``rows`` operators of a profiler table; on a GPU both of its
    sortings."""
    parts = table.split("\n\n")
    return "\n\n".join("\n".join(part.splitlines()[: rows + 4]) for part in parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        harness.child_main(args, measure)
        return 0
    device = harness.resolved_device(args.device)
    machine = harness.machine_info()
    entries, texts = [], []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for run in harness.workload_runs(args):
        spec = {"config": run["config"], "overrides": run["overrides"], "clients": args.clients}
        if args.trace:
            spec["trace"] = str(
                harness.RESULTS_DIR / f"profile_round-{run['workload']}-{run['model']}-{stamp}.trace.json"
            )
            harness.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        print(f"{run['workload']} {run['model']}: profiling {args.clients} clients ...", flush=True)
        result = harness.run_isolated(SCRIPT, spec, device)
        entry = {"workload": run["workload"], "model": run["model"], "overrides": run["overrides"], **result}
        entries.append(entry)
        if result["status"] != "ok":
            print(f"  {result['status']}: {result.get('message')}")
            continue
        print(f"\n{run['workload']} {run['model']}: where a client's time goes (profiled, {entry['clients']} clients)")
        columns = BREAKDOWN_COLUMNS + (DEVICE_COLUMNS if device == "cuda" else [])
        print(harness.format_table(columns, entry["breakdown"]))
        tables = entry.pop("tables")
        for side in ("worker", "server"):
            print(f"\n{run['workload']} {run['model']}: top operators of the {side}, " + top_lines(tables[side], 12))
            texts.append(f"=== {run['workload']} {run['model']}: {side} operators, " + tables[side] + "\n")
    ok = [e for e in entries if e["status"] == "ok"]
    print("\nWall time without the profiler")
    print(harness.format_table(TIMING_COLUMNS, ok))
    path = harness.write_results("profile_round", args, machine, device, ok, {"entries": entries})
    path.with_suffix(".txt").write_text("\n".join(texts))
    print(f"\nwrote {path} and {path.with_suffix('.txt')}")
    return 1 if len(ok) < len(entries) else 0


if __name__ == "__main__":
    sys.exit(main())
