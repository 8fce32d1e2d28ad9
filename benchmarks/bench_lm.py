"""Federated LoRA fine-tuning of a language model: tokens per second and the memory of all
processes, for what users run and for fedsim's ways, on the same model, data, steps and clients.

Four kinds of run (``--kinds``):

- ``sequential``: what the LLM federated-learning libraries run (Shepherd, OpenFedLLM,
  FederatedScope-LLM): one process, one base, the clients one after another with peft adapters
  reset to the global ones, torch.optim.AdamW for each, the adapters averaged by samples;
- ``copies``: fedsim's process backend with a copy of the base in every worker
  (``lora.share_base: false``), as simulators that load the model per client hold it;
- ``shared``: fedsim's process backend on one base every worker reads;
- ``batched``: fedsim's batched adapters (``backend: vmap``), groups of ``--groups`` clients
  trained in lockstep through one pass of the shared base per step.

A LoRA run trains small adapters (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language
Models") on a frozen base that is most of the model. With ``lora.share_base: true`` the server
holds the base once, in shared memory, and every worker takes views of it; with ``false`` each
worker clones it, as simulators that load the model in every client do. What should hold on a
CPU: the total proportional set size (PSS, shared pages counted once) about one base + N adapters
+ per-process overhead with sharing, and about N more bases without; tokens per second alike.

The model is ``char_transformer`` (fedsim/models/language.py, GPT-2's shape over the byte
vocabulary) at GPT-2 small's width and 4 layers, adapters of rank 8 on its attention input
(``c_attn``): a base of about 110 MB, large enough that a copy per worker stands out against a
worker's own few hundred MB, small enough that a 2-core CPU trains a round in seconds. It needs
no tokenizer files, so the same run works on generated and on real text.

Data: ``shakespeare_text`` (the plays' roles as running text, a client per role, byte tokens)
where the data root (``--data-root``, else ``$FEDSIM_DATA``) holds ``shakespeare/texts``, its
test set cut to ``--test-windows`` sequences so that the final evaluation stays short; otherwise
generated text (random words, one document per client) cut into sequences the same way.

Tokens per second: the training tokens of the rounds after the first, divided by their
``train_seconds`` (from opening the round barrier until every worker is done). A client's tokens
are exact: from clients.csv its sample count n and its steps s, the sizes of its first s batches
(each epoch ceil(n / B) batches of B, the last one n mod B where that is not 0) times the sequence
length. Every training target is scored: the only padded sequence of a client is its last, and
the split by time always puts it in the test set (checked on the data in each run).

    python benchmarks/bench_lm.py                          # workers 1,2,4, every kind
    python benchmarks/bench_lm.py --quick                  # a tiny model, seconds
    FEDSIM_DATA=/path/to/datasets python benchmarks/bench_lm.py   # real Shakespeare text
    python benchmarks/bench_lm.py --device cuda --workers 1,2,4,8  # on a GPU: CUDA memory per worker
    python benchmarks/bench_lm.py --figure tokens.png    # and a bar per kind; --replot JSON redraws one
    python benchmarks/bench_lm.py --kinds sequential,shared --workers 1 --threads 2,1 --no-sampler  # a lone worker

``--no-sampler`` leaves out the outside sampler of every process's PSS (four reads a second), whose
reads take CPU from the timed threads: for figures of speed, most of all with rounds of a fraction
of a second or with threads on every core; the PSS is then fedsim's own, read after the first
round and at the end.

fedsim's kinds run with ``threads: 1`` (one torch thread per worker, fedsim's default) unless
``--threads`` names others: each fedsim row is then measured once per thread count. The
sequential loop uses torch's default threads (every core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 (benchmarks/ is not a package)

DEFAULTS = {
    "width": 768,
    "layers": 4,
    "heads": 12,
    "rank": 8,
    "rounds": 4,
    "steps": 2,
    "workers": "1,2,4",
    "groups": "1,4,8",
}
KINDS = ("sequential", "copies", "shared", "batched")
QUICK = {"width": 128, "layers": 2, "heads": 4, "rank": 4, "rounds": 2, "steps": 1, "workers": "1", "groups": "4"}
EVAL_SUBSET = 16  # test sequences scored in the rounds before the last (evaluation is not what this times)
GENERATED_CLIENTS = 100
GENERATED_WINDOWS = 40  # sequences of a generated client, before the split into training and test
TIMING_COLUMNS = [
    ("data", "data", ""),
    ("kind", "kind", ""),
    ("W", "workers", "d"),
    ("threads", "threads", ""),
    ("group", "group", ""),
    ("tokens/round", "tokens_per_round", ",.0f"),
    ("tokens/s", "tokens_per_second", ",.0f"),
    ("train s", "train_seconds", ".2f"),
    ("s/round", "round_seconds", ".2f"),
    ("startup s", "startup_seconds", ".2f"),
    ("loss", "final_test_loss", ".3f"),
    ("x sequential", "to_sequential", ".2f"),
]


def memory_columns(gpu: bool) -> list[tuple[str, str, str]]:
    """fedsim's own figures: PSS per process on a CPU, the CUDA allocator's peaks on a GPU."""
    if gpu:
        return [
            ("kind", "kind", ""),
            ("W", "workers", "d"),
            ("base MB", "frozen_base_mb", ".1f"),
            ("CUDA workers MB", "worker_mb_each", ""),
            ("CUDA workers sum", "worker_mb_total", ".0f"),
            ("CUDA server MB", "server_mb", ".0f"),
            ("CUDA all MB", "all_mb", ".0f"),
        ]
    return [
        ("kind", "kind", ""),
        ("W", "workers", "d"),
        ("base MB", "frozen_base_mb", ".1f"),
        ("PSS workers MB", "worker_mb_each", ""),
        ("PSS workers sum", "worker_mb_total", ".0f"),
        ("PSS server MB", "server_mb", ".0f"),
        ("PSS all MB", "all_mb", ".0f"),
        ("PSS peak MB", "pss_total_mb", ".0f"),
    ]


COMPARE_COLUMNS = [
    ("W", "workers", "d"),
    ("all, shared", "shared_mb", ".0f"),
    ("all, copies", "copies_mb", ".0f"),
    ("difference", "difference_mb", ".0f"),
    ("W x base", "expected_mb", ".0f"),
    ("tokens/s shared", "shared_tokens_per_second", ",.0f"),
    ("tokens/s copies", "copies_tokens_per_second", ",.0f"),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds, 1 worker: seconds")
    parser.add_argument("--workers", help=f"worker counts, comma-separated (default {DEFAULTS['workers']})")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"what to measure, of {', '.join(KINDS)}")
    parser.add_argument("--groups", help="batched: clients per group, vmap_group_size (default 1,4,8)")
    parser.add_argument("--threads", default="1", help="fedsim's kinds: torch threads per worker, comma-separated")
    parser.add_argument("--width", type=int, help=f"char_transformer width (default {DEFAULTS['width']})")
    parser.add_argument("--layers", type=int, help=f"char_transformer layers (default {DEFAULTS['layers']})")
    parser.add_argument("--heads", type=int, help=f"attention heads (default {DEFAULTS['heads']})")
    parser.add_argument("--rank", type=int, help=f"LoRA rank (default {DEFAULTS['rank']})")
    parser.add_argument("--rounds", type=int, help=f"rounds per run (default {DEFAULTS['rounds']})")
    parser.add_argument("--steps", type=int, help=f"local steps per client and round (default {DEFAULTS['steps']})")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--clients-per-round", type=int, default=8)
    parser.add_argument("--test-windows", type=int, default=256, help="test sequences evaluated (real data)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--data-root", help="folder holding shakespeare/texts (default $FEDSIM_DATA; else generated)")
    parser.add_argument(
        "--no-sampler",
        action="store_true",
        help="leave out the outside PSS sampler, whose reads take CPU from the timed threads (for a figure of speed)",
    )
    parser.add_argument("--output", help="results JSON (default benchmarks/results/bench_lm-<device>-<time>.json)")
    parser.add_argument("--figure", help="also draw tokens per second by kind into this PNG")
    parser.add_argument("--replot", metavar="JSON", help="draw --figure from a results file, measuring nothing")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON spec of one measurement
    parser.add_argument("--child-result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ----------------------------------------------------------------------------- in the child


def generated_text(sequence_length: int, seed: int = 0):
    """Random words, one document per client, cut into sequences as shakespeare_text cuts a role."""
    import numpy as np

    from fedsim.data.text import ByteTokenizer, split_by_time, text_dataset, windows

    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["".join(rng.choice(letters, size=rng.integers(1, 9))) for _ in range(500)]
    length = GENERATED_WINDOWS * sequence_length // 6 + 1  # words of 5 letters and a space on average
    documents = [[" ".join(rng.choice(words, size=length))] for _ in range(GENERATED_CLIENTS)]
    x, y, owners = windows(documents, ByteTokenizer(), sequence_length)
    train, test = split_by_time(owners)
    parts = [(x[mask], y[mask], owners[mask]) for mask in (train, test)]
    names = [f"client{i}" for i in range(GENERATED_CLIENTS)]
    return text_dataset(*parts, ByteTokenizer.vocab_size, "generated_text", client_names=names)


def real_text(root: str, sequence_length: int, test_windows: int):
    """shakespeare_text with its first ``test_windows`` test sequences."""
    from fedsim.data.datasets import shakespeare_text
    from fedsim.data.text import ByteTokenizer

    data = shakespeare_text(Path(root), tokenizer=ByteTokenizer(), sequence_length=sequence_length)
    data.test_x, data.test_y = data.test_x[:test_windows], data.test_y[:test_windows]
    data.test_clients = data.test_clients[:test_windows]
    return data


def measure(spec: dict) -> dict:
    """One fedsim run on the data the spec names: its rows, clients, summary and resolved config."""
    from fedsim.data.tensors import IGNORE_INDEX
    from fedsim.runs.launch import run  # torch and the engine load here

    length = spec["config"]["data"]["sequence_length"]
    data = real_text(spec["root"], length, spec["test_windows"]) if spec["root"] else generated_text(length)
    unscored = int((data.train_y == IGNORE_INDEX).sum())
    if unscored:  # tokens_per_client counts every training target
        raise RuntimeError(f"{unscored} training targets are padding; tokens per second would overcount")
    if spec["kind"] == "sequential":
        return {"sequential": sequential_loop(spec, data)}
    config = {**spec["config"], "data": {**spec["config"]["data"], "dataset": data}}
    with tempfile.TemporaryDirectory() as out:
        history = run(config, out=out, overwrite=True, quiet=True)
    return {
        "rows": history.rows,
        "clients": history.client_records,
        "summary": history.summary,
        "config": history.config,
    }


# ----------------------------------------------------------------------------- in the parent


def tokens_per_client(samples: int, steps: int, batch_size: int, sequence_length: int) -> int:
    """Tokens a client trained on: its first ``steps`` batches, epoch after epoch, each epoch
    ``samples`` in batches of ``batch_size`` and a smaller last one for the remainder."""
    full, rest = divmod(samples, batch_size)
    epoch = [batch_size] * full + ([rest] if rest else [])
    if not epoch:
        return 0
    whole_epochs, extra = divmod(steps, len(epoch))
    return (whole_epochs * samples + sum(epoch[:extra])) * sequence_length


def throughput(result: dict, batch_size: int, sequence_length: int) -> dict:
    """Training tokens per second of training over the rounds after the first, and medians."""
    later = result["rows"][1:]
    measured = {row["round"] for row in later}
    tokens = sum(
        tokens_per_client(int(c["samples"]), int(c["steps"]), batch_size, sequence_length)
        for c in result["clients"]
        if int(c["round"]) in measured
    )
    seconds = sum(row["train_seconds"] for row in later)
    return {
        "measured_rounds": len(later),
        "tokens_per_round": tokens / len(later) if later else None,
        "tokens_per_second": tokens / seconds if seconds > 0 else None,
        "train_seconds": statistics.median(row["train_seconds"] for row in later) if later else None,
        "round_seconds": statistics.median(row["seconds"] for row in later) if later else None,
    }


def memory(summary: dict, sampled: dict | None, gpu: bool) -> dict:
    """Per process as fedsim's summary reports it: on a CPU the PSS of every process, read at one
    moment (after the first round or at the end of the run); on a GPU the CUDA allocator's peak
    (no CUDA context); and the PSS of every process sampled from outside."""
    workers = summary.get("worker_peak_memory_mb" if gpu else "worker_pss_mb") or []
    server = summary.get("server_peak_memory_mb" if gpu else "server_pss_mb")
    return {
        "frozen_base_mb": summary.get("frozen_base_mb"),
        "worker_mb": workers,
        "worker_mb_each": "/".join(f"{m:.0f}" for m in workers) or None,
        "worker_mb_total": sum(workers) if workers else None,
        "server_mb": server,
        "all_mb": None if server is None or not workers else server + sum(workers),
        **harness.memory_fields(sampled),
    }


def child_spec(
    args: argparse.Namespace, device: str, kind: str, workers: int, group: int | None, root, threads: int = 1
) -> dict:
    config = {
        "name": f"lm-{kind}-{workers}" + (f"-{group}" if group else "") + (f"-t{threads}" if threads != 1 else ""),
        "seed": 0,
        "rounds": args.rounds,
        "clients_per_round": args.clients_per_round,
        # fedsim's metrics hold the evaluated rounds only: score each, the rounds before the last on a few sequences
        "eval_subset": EVAL_SUBSET,
        "eval_batch_size": 32,  # the server's activations stay small: its PSS after the last round is then steady
        "device": device,
        "workers": workers,
        "threads": threads,
        "model": "char_transformer",
        "model_options": {"layers": args.layers, "width": args.width, "heads": args.heads},
        "data": {
            "partition": "natural",
            "num_clients": 200 if root else GENERATED_CLIENTS,
            "sequence_length": args.sequence_length,
        },
        "lora": {"rank": args.rank, "share_base": kind != "copies"},
        "local": {"optimizer": "adamw", "lr": 1e-3, "batch_size": args.batch_size, "steps": args.steps, "epochs": 1},
    }
    if kind == "batched":
        config.update(backend="vmap", vmap_group_size=group)
    return {"kind": kind, "config": config, "root": root, "test_windows": args.test_windows}


def sequential_loop(spec: dict, data) -> dict:
    """What the LLM federated-learning libraries run: one process and one base, the round's clients
    one after another, each from the global adapters with a fresh torch.optim.AdamW, the adapters
    then averaged by the clients' samples. peft places the adapters as in fedsim's runs. The
    clients, their samples and each round's draw are fedsim's own (its split and its sampling
    stream), so that both train the same clients on the same sequences."""
    import time

    import numpy as np
    import torch
    import torch.nn.functional as F

    from fedsim.experiment.federation import load_federation
    from fedsim.experiment.validation import load_config
    from fedsim.fl.sampling import draw
    from fedsim.models.language import char_transformer
    from fedsim.models.lora import LoraConfig, apply_lora

    cfg, local = spec["config"], spec["config"]["local"]
    length = cfg["data"]["sequence_length"]
    parts = load_federation(load_config({**cfg, "data": {**cfg["data"], "dataset": data}})).parts
    sizes = np.array([len(part) for part in parts], dtype=np.float64)
    torch.manual_seed(0)
    model = char_transformer((length,), data.num_classes, **cfg["model_options"])
    apply_lora(model, LoraConfig(rank=cfg["lora"]["rank"]), "char_transformer")
    adapters = [p for p in model.parameters() if p.requires_grad]
    averaged = [p.detach().clone() for p in adapters]
    rounds = []
    for rnd in range(1, cfg["rounds"] + 1):
        began, tokens, total, samples = time.perf_counter(), 0, [torch.zeros_like(p) for p in adapters], 0
        for client in draw("uniform", cfg["seed"], rnd, np.arange(len(parts)), cfg["clients_per_round"], sizes):
            rows = parts[client]
            with torch.no_grad():
                for p, value in zip(adapters, averaged):
                    p.copy_(value)
            optimizer = torch.optim.AdamW(adapters, lr=local["lr"])
            for _, batch in zip(range(local["steps"]), rows[torch.randperm(len(rows))].split(local["batch_size"])):
                loss = F.cross_entropy(model(data.train_x[batch]).flatten(0, 1), data.train_y[batch].flatten())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                tokens += len(batch) * length
            for t, p in zip(total, adapters):
                t.add_(p.detach(), alpha=len(rows))
            samples += len(rows)
        averaged = [t / samples for t in total]
        rounds.append({"seconds": time.perf_counter() - began, "tokens": tokens})
    later = rounds[1:]
    return {
        "tokens_per_round": statistics.fmean(r["tokens"] for r in later),
        "tokens_per_second": sum(r["tokens"] for r in later) / sum(r["seconds"] for r in later),
        # the loop's round is all training: the same median is both
        **dict.fromkeys(("train_seconds", "round_seconds"), statistics.median(r["seconds"] for r in later)),
    }


def text_root(data_root: str | None) -> str | None:
    """The data root when it holds the play texts, else None (generated text)."""
    root = data_root or os.environ.get("FEDSIM_DATA")
    return root if root and any((Path(root) / "shakespeare" / "texts").glob("*.txt")) else None


def measure_all(args: argparse.Namespace, device: str) -> list[dict]:
    root = text_root(args.data_root)
    data = "shakespeare_text" if root else "generated"
    kinds = [k for k in harness.split_list(args.kinds) if k in KINDS]
    worker_counts = [int(w) for w in harness.split_list(args.workers)]
    groups = [int(g) for g in harness.split_list(args.groups)]
    thread_counts = [int(t) for t in harness.split_list(args.threads)]
    plan = [("sequential", 1, None, None)] if "sequential" in kinds else []
    plan += [
        (kind, w, None, t)
        for kind in ("copies", "shared")
        if kind in kinds
        for w in worker_counts
        for t in thread_counts
    ]
    if "batched" in kinds:  # a worker trains one group at a time: no more workers than groups
        plan += [
            ("batched", w, g, t)
            for g in groups
            for w in worker_counts
            if w <= -(-args.clients_per_round // g)
            for t in thread_counts
        ]
    entries = []
    for kind, workers, group, threads in plan:
        entry = {"data": data, "kind": kind, "workers": workers, "threads": threads or "default", "group": group or ""}
        spec = child_spec(args, device, kind, workers, group, root, threads or 1)
        result = harness.run_isolated(Path(__file__), spec, device, sample_memory=not args.no_sampler)
        entry.update(status=result["status"], message=result.get("message"))
        if result["status"] == "ok" and kind == "sequential":
            entry.update(result["sequential"], **harness.memory_fields(result.get("memory")))
            entry["all_mb"] = entry.get("pss_total_mb")
        elif result["status"] == "ok":
            summary = result["summary"]
            entry.update(throughput(result, args.batch_size, args.sequence_length))
            entry.update(memory(summary, result.get("memory"), device == "cuda"))
            entry.update({k: summary.get(k) for k in ("startup_seconds", "final_test_loss", "device_name")})
            entry.update(rows=result["rows"], summary=summary, backend=result["config"]["backend"])
        entries.append(entry)
        print(
            f"{data} {kind} workers={workers} threads={entry['threads']} group={group or '-'}: {entry['status']}",
            flush=True,
        )
    sequential = next((e for e in entries if e["kind"] == "sequential" and e["status"] == "ok"), None)
    for e in entries:
        if sequential and e.get("tokens_per_second"):
            e["to_sequential"] = e["tokens_per_second"] / sequential["tokens_per_second"]
    return entries


def comparison(entries: list[dict]) -> list[dict]:
    """Per worker count, the memory of the server and its workers (PSS on a CPU, the CUDA allocator's
    peaks on a GPU) with one base and with a copy per worker."""
    ok = {(e["kind"], e["workers"]): e for e in entries if e["status"] == "ok" and e.get("threads", 1) == 1}
    rows = []
    for workers in sorted({w for _, w in ok}):
        shared, copies = ok.get(("shared", workers)), ok.get(("copies", workers))
        if not (shared and copies and shared.get("all_mb") and copies.get("all_mb")):
            continue
        rows.append(
            {
                "workers": workers,
                "shared_mb": shared["all_mb"],
                "copies_mb": copies["all_mb"],
                "difference_mb": copies["all_mb"] - shared["all_mb"],
                "expected_mb": workers * (shared["frozen_base_mb"] or 0),
                "shared_tokens_per_second": shared["tokens_per_second"],
                "copies_tokens_per_second": copies["tokens_per_second"],
            }
        )
    return rows


def report(entries: list[dict], args: argparse.Namespace, device: str) -> list[dict]:
    ok = [e for e in entries if e["status"] == "ok"]
    name = next((e["device_name"] for e in ok if e.get("device_name")), device)
    print(f"\nchar_transformer width {args.width}, {args.layers} layers, LoRA rank {args.rank} on c_attn; {name}")
    print("\nTraining tokens per second (rounds after the first, see the module's docstring)")
    print(harness.format_table(TIMING_COLUMNS, ok))
    what = (
        "CUDA allocator peaks per process"
        if device == "cuda"
        else "PSS per process, read together after the first round and at the end"
    )
    print(f"\nMemory: {what} (fedsim's summary), PSS of all processes sampled from outside")
    gpu = device == "cuda"
    sampled = [c for c in harness.memory_columns(gpu) if gpu or c[1] != "pss_total_mb"]  # PSS peak is ours on a CPU
    print(harness.format_table(memory_columns(gpu) + sampled, ok))
    rows = comparison(entries)
    if rows:
        what = "CUDA allocator peaks" if gpu else "PSS"
        print(f"\nOne base for every worker against a copy per worker ({what} of the server and workers, MB)")
        print(harness.format_table(COMPARE_COLUMNS, rows))
    for e in entries:
        if e["status"] != "ok":
            print(f"{e['kind']} workers={e['workers']}: {e['status']}: {e['message']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        harness.child_main(args, measure)
        return 0
    if args.replot:
        results = json.loads(Path(args.replot).read_text())
        draw(results["entries"], results["machine"], args.figure or str(Path(args.replot).with_suffix(".png")))
        return 0
    device = harness.resolved_device(args.device)
    machine = harness.machine_info()
    entries = measure_all(args, device)
    rows = report(entries, args, device)
    path = harness.write_results("bench_lm", args, machine, device, entries, {"entries": entries, "comparison": rows})
    print(f"\nwrote {path}")
    if args.figure:
        draw(entries, machine, args.figure)
    return 1 if any(e["status"] == "failed" for e in entries) else 0


def draw(entries: list[dict], machine: dict, path: str) -> None:
    """Tokens per second of every measured kind, a bar each, the sequential loop's as a line."""
    from matplotlib.figure import Figure

    done = [e for e in entries if e["status"] == "ok"]
    labels = [
        e["kind"]
        + ("" if e["kind"] == "sequential" else f"\nW={e['workers']}")
        + (f" g={e['group']}" if e["group"] else "")
        + (f" t={e['threads']}" if e.get("threads", 1) not in (1, "default") else "")
        for e in done
    ]
    colors = {"sequential": "0.45", "copies": "tab:orange", "shared": "tab:blue", "batched": "tab:green"}
    figure = Figure(figsize=(1.0 + 0.75 * len(done), 3.6), layout="constrained")  # no pyplot state
    axes = figure.subplots()
    axes.bar(range(len(done)), [e["tokens_per_second"] for e in done], color=[colors[e["kind"]] for e in done])
    sequential = [e["tokens_per_second"] for e in done if e["kind"] == "sequential"]
    if sequential:
        axes.axhline(sequential[0], color="0.45", linestyle="--", linewidth=1)
    axes.set_xticks(range(len(done)), labels, fontsize=8)
    axes.set_ylabel("training tokens / s")
    load = f"load {machine.get('load_average_start', ['?'])[0]} to {machine.get('load_average_end', ['?'])[0]}"
    axes.set_title(f"{machine.get('device_name')}, torch {machine.get('torch')}, {load}", fontsize=9)
    figure.savefig(path, dpi=120)
    print(f"drew {path}")


if __name__ == "__main__":
    sys.exit(main())
