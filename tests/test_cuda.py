"""The same contracts on a GPU: CUDA IPC buffers, both backends, host placement, and the
failure, interrupt and resume paths. Skipped without CUDA."""

from __future__ import annotations

import signal
import time
import uuid

import pytest
import torch
from support import BASE, run_cli, start, tagged_processes, wait_for_round, write_config, write_faulty_config

import fedsim

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

CUDA = {**BASE, "device": "cuda"}


def close(a, b, tolerance):
    return max(abs(x - y) for x, y in zip(a, b)) <= tolerance


def test_backends_and_placements_agree_on_the_gpu(tmp_path):
    cfg = {**CUDA, "model": "mnist_2nn", "rounds": 3}  # no dropout: both backends see the same batches
    process = fedsim.run(cfg, out=tmp_path / "process", quiet=True)
    vmap = fedsim.run(cfg, out=tmp_path / "vmap", quiet=True, backend="vmap", workers=1)
    host = fedsim.run(cfg, out=tmp_path / "host", quiet=True, **{"data.placement": "host"})
    assert process.summary["device"].startswith("cuda:")
    assert process.test_accuracy[-1] > 0.5
    assert close(process.train_loss, vmap.train_loss, 1e-3)
    assert close(process.test_accuracy, host.test_accuracy, 0.05)  # host shuffles come from CPU generators
    assert all(m > 0 for m in process.summary["worker_peak_memory_mb"])


def test_worker_failure_on_the_gpu_ends_in_one_line(tmp_path):
    config, client = write_faulty_config(tmp_path, "kill", 2, 1, device="cuda")
    code, _, err, seconds, tag = run_cli(["run", str(config), "--out", str(tmp_path / "run")])
    assert code == 1 and seconds < 60 and "killed by SIGKILL" in err
    assert f"worker 1 failed while training client {client} in round 2" in err
    assert tagged_processes(tag) == []


def test_interrupt_and_resume_on_the_gpu(tmp_path):
    full = fedsim.run(CUDA, out=tmp_path / "full", quiet=True, rounds=6)
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    proc = start(["run", str(write_config(tmp_path, device="cuda", rounds=6)), "--out", str(run_dir)], tag)
    wait_for_round(proc, 3)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    time.sleep(0.5)
    assert tagged_processes(tag) == []
    code, _, err, _, _ = run_cli(["run", "--resume", str(run_dir)])
    assert code == 0, err
    resumed = fedsim.load_run(run_dir)
    assert resumed.round == full.round
    # cuDNN may choose other kernels in a new process, so a GPU resume agrees closely, not bitwise
    assert close(resumed.test_accuracy, full.test_accuracy, 0.02)


def test_the_dataset_is_on_the_device_once(tmp_path):
    """Each worker maps the server's buffers: its own allocations (a batch's activations, the
    model and its gradients, and cuBLAS's workspace, which the allocator counts: 32 MiB a stream on
    Hopper) stay below half of one copy of the training set, which is made large enough that any
    copy would show whatever the GPU."""
    n = 60_000  # 60,000 x 784 float32: 188 MB
    g = torch.Generator().manual_seed(0)
    data = fedsim.data.from_tensors(
        torch.randn(n, 1, 28, 28, generator=g),
        torch.randint(0, 10, (n,), generator=g),
        torch.randn(1_000, 1, 28, 28, generator=g),
        torch.randint(0, 10, (1_000,), generator=g),
    )
    data_mb = data.train_x.numel() * data.train_x.element_size() / 2**20
    cfg = {**CUDA, "rounds": 1, "data": {"dataset": data, "num_clients": 8}}
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    assert max(history.summary["worker_peak_memory_mb"]) < data_mb / 2


def test_async_rounds_on_the_gpu_start_each_slot_from_its_own_model(tmp_path):
    """FedBuff on CUDA IPC buffers: the slots' own starts reach the workers; 1 and 2 workers agree
    closely (cuDNN may pick other kernels per process) and the clients' loss falls."""
    cfg = {
        **CUDA,
        "model": "mnist_2nn",
        "rounds": 4,
        "mode": "async",
        "asynchronous": {"buffer_size": 2},
        "system": {"speed": {"lognormal": 1.0}},
    }
    one = fedsim.run(cfg, out=tmp_path / "w1", quiet=True, workers=1)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    assert one.simulated_time == two.simulated_time  # the clock does not depend on the device's arithmetic
    assert close(one.train_loss, two.train_loss, 1e-3)
    assert one.train_loss[-1] < one.train_loss[0] and one.test_accuracy[-1] > 0.5


def test_the_frozen_base_of_a_lora_model_is_on_the_device_once(tmp_path):
    """Each worker takes views of the server's frozen base through CUDA IPC: its own allocations
    stay below half of the base, made large enough (a 42.7 M-parameter transformer, 163 MB: its
    half is well above cuBLAS's 32 MiB workspace, which the allocator counts) to show a copy
    whatever the GPU; with a copy per worker they hold one base each."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (400, 33), generator=g)
    data = fedsim.data.Dataset(ids[:320, :-1], ids[:320, 1:], ids[320:, :-1], ids[320:, 1:], 256, name="tokens")
    cfg = {
        **CUDA,
        "rounds": 1,
        "clients_per_round": 2,
        "workers": 2,
        "model": "char_transformer",
        "model_options": {"layers": 6, "width": 768, "heads": 12},
        "lora": {"rank": 4},
        "data": {"dataset": data, "num_clients": 2},
        "local": {"optimizer": "adamw", "lr": 1e-3, "batch_size": 8, "steps": 2},
    }
    shared = fedsim.run(cfg, out=tmp_path / "shared", quiet=True)
    copied = fedsim.run({**cfg, "lora": {"rank": 4, "share_base": False}}, out=tmp_path / "copied", quiet=True)
    base = shared.summary["frozen_base_mb"]
    assert base > 160 and max(shared.summary["worker_peak_memory_mb"]) < base / 2
    assert min(copied.summary["worker_peak_memory_mb"]) > base
    assert shared.test_loss == copied.test_loss
