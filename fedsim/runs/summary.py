"""summary.json: what a run was (its parts, how much of its model it trained), how it went (final
and best scores, rounds to a target), each feature's figure (megabytes sent, epsilon, staleness,
personal accuracy), and where and on what it ran."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..core.errors import FedsimError, exception_text
from ..core.flat import base_bytes
from ..engine.state import GlobalState
from ..engine.update import update_sizes
from ..execution.resources import cpu_name, load_average, peak_memory_mb
from ..experiment.components import describe
from ..experiment.config import Config
from ..fl.compression import Compression
from ..results.history import scored_alike


def account(session: Any, status: str, ended_by: BaseException | None) -> dict:
    """summary.json of a Session (runs/session.py) ending with ``status``: what ran, how it went,
    each feature's figure, the clients' kept state, the times, where it ran and in what."""
    s = session
    failed = status == "failed" and ended_by is not None
    error = str(ended_by) if isinstance(ended_by, FedsimError) else exception_text(ended_by) if failed else None
    personal = s.state.algorithm.has_personal_model
    return {
        "name": s.cfg.name,
        "status": status,
        **({"error": error} if failed else {}),  # what ended a failed run, in the words of its one line
        **what_ran(s.cfg.to_dict(), s.state.model.module, s.input_shape, s.num_classes, s.overrides, s.first_round),
        "aggregation": s.state.algorithm.aggregation(describe(s.cfg.aggregator)),
        # FedProto's clients exchange no weights: its global model, which test_accuracy scores, never trains
        **({} if s.state.algorithm.exchanges_weights else {"global_model_trained": False}),
        **outcome(s.rows, s.cfg.stop_at_accuracy),
        **(
            personal_outcome(s.rows, s.client_eval.samples, s.state.trained_clients())
            if s.client_eval and personal
            else {}
        ),
        **feature_figures(s.cfg, s.rows, s.client_rows, update_bytes(s.state, s.compression)),
        **s.state.algorithm.summary(s.client_rows),
        "checkpoint_round": s.state.saved_round,
        "bytes_sent": s.state.bytes_sent,
        **({"rounds_left_out": s.state.rounds_left_out} if s.state.rounds_left_out else {}),
        **s.state.clients.summary(),
        **({"client_eval_model": "personal" if personal else "global"} if s.client_eval else {}),
        "startup_seconds": s.startup_seconds,
        "wall_seconds": round(s.elapsed_before + time.perf_counter() - s.t_start, 3),
        **where_it_ran(s.device, s.workers, *s.worker_memory, s.state),
        **({"ranks": s.executor.rank_memory} if s.ranks.several else {}),
        "torch": torch.__version__,  # its build: +cpu, +cu130 (a CUDA build, whatever the device it ran on)
        "cpus": os.cpu_count(),
        "load_average": load_average(),  # the 1-minute load average as the run ended
    }


def what_ran(
    config: dict, model: torch.nn.Module, input_shape: tuple, num_classes: int, overrides: dict, first_round: int
) -> dict:
    """summary.json's account of what ran: the experiment's parts (LoRA's method and rank, the
    server optimizer), how many of the model's parameters it trained, the shape of its data (what
    load_model builds the model for), the keys set on top of its file, and the round a resumed
    run went on from."""
    lora = config["lora"]
    return {
        **{key: config[key] for key in ("model", "aggregator", "algorithm", "server_optimizer")},
        "lora": (
            {"method": lora["method"], "rank": lora["rank"]}
            | ({"client_ranks": lora["client_ranks"]} if lora.get("client_ranks") is not None else {})
            if lora["rank"] > 0
            else None
        ),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "total_parameters": sum(p.numel() for p in model.parameters()),
        "dataset": config["data"]["dataset"],
        "partition": config["data"]["partition"],
        "input_shape": list(input_shape),
        "num_classes": num_classes,
        "overrides": overrides,
        "resumed_at_round": first_round if first_round > 1 else None,
    }


def outcome(rows: list[dict], target: float | None) -> dict:
    """summary.json's account of how the run went, from its evaluated rounds' rows. A token-level
    run (a language model: rows with ``test_perplexity``) also has ``final_test_perplexity`` and
    ``best_test_perplexity`` (the lowest); its accuracies are token accuracies. Every figure comes
    from the rounds scored on the set the last round was, ``test_samples`` of them (the whole test
    set: with eval_subset, the rounds scored on its subset are left out of the best figures and of
    ``rounds_to_target``)."""
    alike = scored_alike(rows)
    accuracies = [r["test_accuracy"] for r in alike]
    perplexities = [r["test_perplexity"] for r in alike if r.get("test_perplexity") is not None]
    return {
        "rounds": rows[-1]["round"] if rows else 0,
        "test_samples": rows[-1].get("test_samples") if rows else None,
        "final_test_accuracy": accuracies[-1] if accuracies else None,
        "best_test_accuracy": max(accuracies) if accuracies else None,
        "final_test_loss": rows[-1]["test_loss"] if rows else None,
        **(
            {"final_test_perplexity": perplexities[-1], "best_test_perplexity": min(perplexities)}
            if perplexities
            else {}
        ),
        "rounds_to_target": next((r["round"] for r in alike if target and r["test_accuracy"] >= target), None),
    }


def personal_outcome(rows: list[dict], samples: torch.Tensor, trained: set[int]) -> dict:
    """summary.json's account of the personal models (a run whose client_eval_model is personal):
    the final and best mean accuracy of the clients' own models on their own test splits, over the
    ``personal_clients`` with a split (``samples``, each client's), of which
    ``personal_untrained_clients`` never trained (not in ``trained``) and were scored with the model
    they would start from."""
    means = [r["client_accuracy_mean"] for r in rows if r.get("client_accuracy_mean") is not None]
    scored = [c for c, n in enumerate(samples.tolist()) if n]
    return {
        "final_personal_accuracy": means[-1] if means else None,
        "best_personal_accuracy": max(means, default=None),
        "personal_clients": len(scored),
        "personal_untrained_clients": sum(1 for c in scored if c not in trained),
    }


def feature_figures(cfg: Config, rows: list[dict], client_rows: list[dict], update_bytes: tuple | None) -> dict:
    """summary.json's figure of each feature the run had on, and only of those; and of every run
    that sends anything (all but hogwild's) its traffic, the baseline compression is judged by.

    ``megabytes_sent``, the bytes sent down and up since round 1 over 10^6; ``compression_ratio``,
    those bytes over what the same rounds would have sent uncompressed: the same traffic with each
    update that arrived (a clients.csv row whose work was not lost as a dropout or straggler) at
    its whole size instead (``update_bytes``: an update's bytes whole and compressed; None, and so
    a ratio of 1, without compression).

    privacy: the last evaluated round's ``final_epsilon`` and the config's ``delta``. async: the
    ``staleness_mean`` and ``staleness_max`` of the updates used (clients.csv rows with dropped 0).
    dropouts or a deadline: ``clients_lost``, the clients.csv rows lost as dropout or straggler."""
    figures = {}
    sent = rows[-1].get("cumulative_bytes") if rows else None
    if sent is not None:
        arrived = sum(1 for r in client_rows if r["dropped"] not in ("dropout", "straggler"))
        whole = sent + arrived * (update_bytes[0] - update_bytes[1] if update_bytes else 0)
        figures |= {"megabytes_sent": sent / 1e6, "compression_ratio": sent / whole if whole else None}
    if cfg.privacy:
        figures |= {"final_epsilon": rows[-1].get("epsilon") if rows else None, "delta": cfg.privacy.delta}
    if cfg.mode == "async":
        stale = [r["staleness"] for r in client_rows if r["dropped"] == 0 and r.get("staleness") is not None]
        figures |= {
            "staleness_mean": sum(stale) / len(stale) if stale else None,
            "staleness_max": max(stale, default=None),
        }
    if cfg.system.dropout or cfg.system.deadline is not None:
        figures["clients_lost"] = sum(1 for r in client_rows if r["dropped"] in ("dropout", "straggler"))
    return figures


def update_bytes(state: GlobalState, compression: Compression | None) -> tuple[int, int] | None:
    """An update's bytes whole and as compression sends it, as engine/update.py counts them
    (``update_sizes``); None without compression."""
    return update_sizes(state, compression) if compression else None


def where_it_ran(
    device: torch.device,
    workers: int,
    worker_peak_memory: list[int],
    worker_pss: list[int],
    server_pss: int,
    state: GlobalState,
) -> dict:
    """summary.json's account of the machine: the device, the workers and the memory they took.
    On a CPU also each process's proportional set size, in which memory shared by several
    processes (the data, a frozen base) counts once over all of them, read for every process at
    one moment (after the first round and at the end of the run, whichever sum was higher), and
    that sum; and the frozen base's size."""
    megabytes = lambda sizes: [round(b / 2**20, 1) for b in sizes]  # noqa: E731
    if not workers:  # the clients trained in the server's own process, whose figures these are
        worker_peak_memory, worker_pss = [], []
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "workers": workers,
        "worker_peak_memory_mb": megabytes(worker_peak_memory),
        "server_peak_memory_mb": peak_memory_mb(device),
        **(
            {
                "worker_pss_mb": megabytes(worker_pss),
                "server_pss_mb": megabytes([server_pss])[0],
                "total_pss_mb": megabytes([server_pss + sum(worker_pss)])[0],
            }
            if device.type == "cpu" and server_pss
            else {}
        ),
        **({"frozen_base_mb": round(base_bytes(state.model.base) / 2**20, 1)} if state.model.base else {}),
    }
