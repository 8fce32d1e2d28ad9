"""Bad input: one line on stderr naming the file and key and what is allowed, exit status 2."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml

import fedsim
from fedsim.cli import main
from fedsim.core.errors import FedsimError

GOOD = {
    "name": "bad",
    "device": "cpu",
    "rounds": 1,
    "workers": 0,
    "clients_per_round": 2,
    "data": {"dataset": "synthetic", "num_clients": 4, "limit": 1200},
}


PRIVATE = {"clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-5}


def with_change(dotted: str, value):
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    node, *path = [cfg, *dotted.split(".")]
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return yaml.safe_dump(cfg)


# (id, experiment file text or None for no file, extra CLI args, fragments the message holds)
CASES = [
    ("unknown key", with_change("roundz", 3), [], ["exp.yaml: roundz: unknown key", "did you mean 'rounds'"]),
    (
        "unknown nested key",
        with_change("local.batchsize", 8),
        [],
        ["exp.yaml: local.batchsize: unknown key", "did you mean 'local.batch_size'"],
    ),
    ("wrong type", with_change("rounds", "ten"), [], ["exp.yaml: rounds: expected an integer, got str 'ten'"]),
    ("section not a mapping", with_change("local", 5), [], ["exp.yaml: local: expected a mapping"]),
    ("negative lr", with_change("local.lr", -0.1), [], ["exp.yaml: local.lr: must be > 0, got -0.1"]),
    ("zero rounds", with_change("rounds", 0), [], ["exp.yaml: rounds: must be >= 1, got 0"]),
    (
        "too many clients per round",
        with_change("clients_per_round", 9),
        [],
        ["exp.yaml: clients_per_round: must be <= data.num_clients (4), got 9"],
    ),
    ("too many workers", with_change("workers", 3), [], ["exp.yaml: workers: must be <= clients_per_round (2)"]),
    ("no threads", with_change("threads", 0), [], ["exp.yaml: threads: must be >= 1, got 0"]),
    (
        "unknown dataset",
        with_change("data.dataset", "imagenet"),
        [],
        ["exp.yaml: data.dataset: unknown dataset 'imagenet'; choose one of:", "mnist", "synthetic"],
    ),
    (
        "unknown model",
        with_change("model", "vgg"),
        [],
        ["exp.yaml: model: unknown model 'vgg'; choose one of:", "mnist_cnn"],
    ),
    ("model: null", with_change("model", None), [], ["exp.yaml: model: expected a name, an import path"]),
    (
        "unknown aggregator",
        with_change("aggregator", "avg"),
        [],
        ["exp.yaml: aggregator: unknown aggregator 'avg' (did you mean 'fedavg'?); choose one of:", "median"],
    ),
    (
        "unknown partition",
        with_change("data.partition", "random"),
        [],
        ["exp.yaml: data.partition: unknown partition 'random'; choose one of:", "iid"],
    ),
    (
        "momentum out of range",
        with_change("local.momentum", 1.5),
        [],
        ["exp.yaml: local.momentum: must be in [0, 1), got 1.5"],
    ),
    (
        "accuracy target out of range",
        with_change("stop_at_accuracy", 99),
        [],
        ["exp.yaml: stop_at_accuracy: must be a fraction in (0, 1]"],
    ),
    ("bad device", with_change("device", "gpu"), [], ["exp.yaml: device: must be auto, cpu, cuda or cuda:N"]),
    ("bad policy", with_change("on_nonfinite", "ignore"), [], ["exp.yaml: on_nonfinite: must be one of drop, fail"]),
    ("yaml syntax", "rounds: 3\nlocal:\n  lr: [0.1\n", [], ["exp.yaml: YAML syntax error at line 4"]),
    ("not a mapping", "- rounds\n- 3\n", [], ["exp.yaml: expected a mapping of keys at the top level, got list"]),
    ("missing file", None, [], ["exp.yaml: file not found"]),
    (
        "bad override key",
        yaml.safe_dump(GOOD),
        ["--set", "local.lrr=0.1"],
        ["--set local.lrr: unknown key", "did you mean 'local.lr'"],
    ),
    ("bad override value", yaml.safe_dump(GOOD), ["--set", "rounds=-1"], ["--set rounds: must be >= 1, got -1"]),
    ("override without =", yaml.safe_dump(GOOD), ["--set", "rounds"], ["--set rounds: expected dotted.key=value"]),
    (
        "no data and no download",
        with_change("data", {"dataset": "mnist", "num_clients": 4, "download": False, "root": "/nonexistent/data"}),
        [],
        ["data.root: no MNIST files in /nonexistent/data/MNIST/raw (data.download is false)"],
    ),
    (
        "aggregator option",
        with_change("aggregator_options", {"bogus": 1}),
        [],
        ["exp.yaml: aggregator_options: fedavg takes no option 'bogus'"],
    ),
    # numbers: finite, in range, representable by the engine (int64, float32, C-int timeouts)
    ("nan lr", yaml.safe_dump(GOOD), ["--set", "local.lr=.nan"], ["--set local.lr: must be a finite number"]),
    (
        "inf timeout",
        yaml.safe_dump(GOOD),
        ["--set", "worker_timeout=.inf"],
        ["--set worker_timeout: must be a finite number"],
    ),
    (
        "huge timeout",
        yaml.safe_dump(GOOD),
        ["--set", "worker_timeout=1e9"],
        ["--set worker_timeout: must be > 0 and at most 1,000,000 seconds"],
    ),
    ("nan momentum", with_change("local.momentum", float("nan")), [], ["exp.yaml: local.momentum: must be a finite"]),
    (
        "nan weight decay",
        yaml.safe_dump(GOOD),
        ["--set", "local.weight_decay=.nan"],
        ["--set local.weight_decay: must be a finite number"],
    ),
    (
        "inf mu",
        yaml.safe_dump(GOOD),
        ["--set", "algorithm=fedprox", "--set", "algorithm_options.mu=.inf"],
        ["--set algorithm_options: mu must be 0 or a number > 0 in float32's normal range", "got inf"],
    ),
    (
        "negative alpha",
        yaml.safe_dump(GOOD),
        ["--set", "algorithm=feddyn", "--set", "algorithm_options.alpha=-1"],
        ["--set algorithm_options: alpha must be a number > 0", "got -1"],
    ),
    (
        "unknown algorithm option",
        yaml.safe_dump(GOOD),
        ["--set", "algorithm=fedprox", "--set", "algorithm_options.nu=1"],
        ["--set algorithm_options: fedprox takes no option 'nu'; it takes: mu"],
    ),
    (
        "option written without the space after its colon",
        yaml.safe_dump(GOOD),
        ["--set", "pre_aggregators=[{bucketing: {s:2}}]"],
        [
            "--set pre_aggregators[0]: bucketing takes no option 's:2'; it takes: s (YAML reads a colon with no space"
            " after it as part of the name: write s: 2)"
        ],
    ),
    ("moved key", yaml.safe_dump(GOOD), ["--set", "local.mu=0.1"], ["--set local.mu: is now algorithm_options.mu"]),
    # components named by import path: importable, the right kind, the right signature
    (
        "model not importable",
        yaml.safe_dump(GOOD),
        ["--set", "model=no_such_package.nets:build"],
        ["--set model: cannot import 'no_such_package.nets' (ModuleNotFoundError: No module named 'no_such_package')"],
    ),
    (
        "model attribute missing",
        yaml.safe_dump(GOOD),
        ["--set", "model=fedsim.models.zoo:no_such_net"],
        ["--set model: module 'fedsim.models.zoo' has no attribute 'no_such_net'"],
    ),
    (
        "model of the wrong signature",
        yaml.safe_dump(GOOD),
        ["--set", "model=os.path:basename"],
        ["--set model: posixpath:basename takes (p); a model builder takes no arguments or (input_shape, num_classes)"],
    ),
    (
        "model that is no function",
        yaml.safe_dump(GOOD),
        ["--set", "model=fedsim.models.zoo:MODELS"],
        ["--set model: fedsim.models.zoo:MODELS is a Registry, not a function or nn.Module class"],
    ),
    (
        "rule of the wrong signature",
        yaml.safe_dump(GOOD),
        ["--set", "aggregator=math:sqrt"],
        ["--set aggregator: math:sqrt takes (x); a rule takes (updates, weights, **options)"],
    ),
    (
        "unknown rule",
        yaml.safe_dump(GOOD),
        ["--set", "aggregator=medain"],
        [
            "--set aggregator: unknown aggregator 'medain' (did you mean 'median'?); choose one of:",
            "or give an import path (pkg.module:name)",
        ],
    ),
    (
        "misspelt choice",
        yaml.safe_dump(GOOD),
        ["--set", "backend=vmp"],
        ["--set backend: must be one of process, vmap, got 'vmp' (did you mean 'vmap'?)"],
    ),
    (
        "algorithm that is no Algorithm",
        yaml.safe_dump(GOOD),
        ["--set", "algorithm=fedsim.models.zoo:MnistCNN"],
        ["--set algorithm: fedsim.models.zoo:MnistCNN is not a fedsim Algorithm"],
    ),
    (
        "dataset file missing",
        yaml.safe_dump(GOOD),
        ["--set", "data.dataset=no_such_file.npz"],
        ["--set data.dataset: no_such_file.npz: no such file"],
    ),
    (
        "dataset that is no function",
        yaml.safe_dump(GOOD),
        ["--set", "data.dataset=fedsim.data:DATASETS"],
        ["--set data.dataset: fedsim.data:DATASETS is not a function returning a Dataset"],
    ),
    ("nan server lr", yaml.safe_dump(GOOD), ["--set", "server_lr=.nan"], ["--set server_lr: must be a finite"]),
    ("nan server beta", yaml.safe_dump(GOOD), ["--set", "server_beta2=.nan"], ["--set server_beta2: must be a finite"]),
    (
        "huge server tau",
        yaml.safe_dump(GOOD),
        ["--set", "server_tau=1e30"],
        ["--set server_tau: must be > 0 and at most 1e18"],
    ),
    (
        "nan attack fraction",
        yaml.safe_dump(GOOD),
        ["--set", "attack.fraction=.nan"],
        ["--set attack.fraction: must be a finite number"],
    ),
    (
        "inf attack scale",
        yaml.safe_dump(GOOD),
        ["--set", "attack.scale=-.inf"],
        ["--set attack.scale: must be a finite number"],
    ),
    (
        "scale beyond float32",
        yaml.safe_dump(GOOD),
        ["--set", "attack.scale=1e39"],
        ["--set attack.scale: must be a finite number within ±3.4e38 (float32)", "got 1e+39"],
    ),
    (
        "nan accuracy target",
        yaml.safe_dump(GOOD),
        ["--set", "stop_at_accuracy=.nan"],
        ["--set stop_at_accuracy: must be a finite number"],
    ),
    ("nan alpha", with_change("data.alpha", float("nan")), [], ["exp.yaml: data.alpha: must be a finite number"]),
    ("zero alpha", yaml.safe_dump(GOOD), ["--set", "data.alpha=0"], ["--set data.alpha: must be > 0, got 0.0"]),
    ("inf sigma", yaml.safe_dump(GOOD), ["--set", "data.sigma=.inf"], ["--set data.sigma: must be a finite number"]),
    ("negative sigma", yaml.safe_dump(GOOD), ["--set", "data.sigma=-1"], ["--set data.sigma: must be >= 0"]),
    (
        "negative min samples",
        yaml.safe_dump(GOOD),
        ["--set", "data.min_samples=-1"],
        ["--set data.min_samples: must be >= 0"],
    ),
    (
        "zero shards",
        yaml.safe_dump(GOOD),
        ["--set", "data.shards_per_client=0"],
        ["--set data.shards_per_client: must be >= 1"],
    ),
    (
        "zero classes",
        yaml.safe_dump(GOOD),
        ["--set", "data.classes_per_client=0"],
        ["--set data.classes_per_client: must be >= 1"],
    ),
    (
        "unknown quantity skew",
        yaml.safe_dump(GOOD),
        ["--set", "data.quantity_skew=zipf"],
        ["--set data.quantity_skew: must be one of lognormal, dirichlet"],
    ),
    (
        "rounds beyond int64",
        yaml.safe_dump(GOOD),
        ["--set", f"rounds={2**64}"],
        ["--set rounds: must be within ±(2^63 - 1)", "65-bit integer"],
    ),
    ("seed beyond int64", with_change("seed", 10**30), [], ["exp.yaml: seed: must be within ±(2^63 - 1)"]),
    (
        "limit beyond int64",
        yaml.safe_dump(GOOD),
        ["--set", f"data.limit={2**70}"],
        ["--set data.limit: must be within ±(2^63 - 1)"],
    ),
    ("an integer of 5000 digits", "rounds: " + "9" * 5000 + "\n", [], ["exp.yaml: YAML error:", "digits"]),
    (
        "too many clients",
        yaml.safe_dump(GOOD),
        ["--set", "data.num_clients=1000000000"],
        ["--set data.num_clients: must be at most 100,000,000"],
    ),
    (
        "nan aggregator option",
        with_change("aggregator_options", {"beta": float("nan")}),
        ["--set", "aggregator=trimmed_mean"],
        ["aggregator_options: beta must be a number in [0, 0.5), got nan"],
    ),
    (
        "inf aggregator option",
        with_change("aggregator_options", {"max_norm": float("inf")}),
        ["--set", "aggregator=norm_clip"],
        ["aggregator_options: max_norm must be a number > 0", "got inf"],
    ),
    (
        "subnormal lr",
        yaml.safe_dump(GOOD),
        ["--set", "local.lr=1e-45"],
        ["--set local.lr: must be a finite number within ±3.4e38 (float32), and 0 or at least 1.2e-38 in size"],
    ),
    (
        "subnormal server tau",
        yaml.safe_dump(GOOD),
        ["--set", "server_tau=1e-200"],
        ["--set server_tau: must be a finite number", "at least 1.2e-38"],
    ),
    (
        "an option set by --set is named so",
        yaml.safe_dump(GOOD),
        ["--set", "aggregator=norm_clip", "--set", "aggregator_options.max_norm=-1"],
        ["--set aggregator_options: max_norm must be a number > 0", "got -1"],
    ),
    (
        "device with a newline",
        yaml.safe_dump(GOOD),
        ["--set", "device='cpu\n'"],
        ["--set device: must be auto, cpu, cuda or cuda:N"],
    ),
    # a section that holds no mapping is an error, never silently replaced by --set
    (
        "list section plus --set",
        with_change("local", [1, 2]),
        ["--set", "local.lr=0.05"],
        ["exp.yaml: local: expected a mapping of keys (for --set local.lr), got list [1, 2]"],
    ),
    (
        "number options plus --set",
        with_change("aggregator_options", 5),
        ["--set", "aggregator_options.beta=0.1"],
        ["exp.yaml: aggregator_options: expected a mapping of keys (for --set aggregator_options.beta), got int 5"],
    ),
    (
        "--set into a number",
        yaml.safe_dump(GOOD),
        ["--set", "rounds.every=2"],
        ["exp.yaml: rounds: expected a mapping of keys (for --set rounds.every), got int 1"],
    ),
    (
        "--set a section to a number",
        yaml.safe_dump(GOOD),
        ["--set", "local=5"],
        ["--set local: expected a mapping of keys, got int 5"],
    ),
    (
        "a key given twice",
        "rounds: 1\nlocal:\n  lr: 0.1\nlocal:\n  epochs: 2\n",
        [],
        ["exp.yaml: YAML refused at line 4, column 1: key 'local' given twice in one mapping"],
    ),
    # hostile YAML: bounded size and depth, short messages
    (
        "alias bomb",
        "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdef", "bcdefg")).replace("*a", '"lol"'),
        [],
        ["exp.yaml: YAML refused at line 1", "expands into more than 10,000 values"],
    ),
    ("recursive alias", "a: &a [*a]\n", [], ["exp.yaml: YAML refused", "expands into more than 10,000 values"]),
    (
        "deep nesting",
        "rounds: " + "[" * 5000 + "]" * 5000 + "\n",
        [],
        ["exp.yaml: YAML refused at line 1", "nested more than 32 levels deep"],
    ),
    (
        "deep --set value",
        yaml.safe_dump(GOOD),
        ["--set", "local.lr=" + "[" * 500 + "]" * 500],
        ["--set local.lr: YAML refused: nested more than 32 levels deep"],
    ),
    ("huge file", "# " + "x" * (2 << 20) + "\n", [], ["exp.yaml: 2,097,155 bytes is too large for an experiment file"]),
    ("binary file", "\x00\x01\x02binary", [], ["exp.yaml: YAML error: unacceptable character #x0000"]),
    (
        "long value in a message",
        with_change("rounds", "x" * 10_000),
        [],
        ["exp.yaml: rounds: expected an integer, got str 'xxxxx"],
    ),
    # names: the run directory is derived safely, but a name must be printable
    (
        "NUL in name",
        yaml.safe_dump(GOOD),
        ["--set", 'name="a\\0b"'],
        ["--set name: must be text of at most 1,000 characters without NUL bytes"],
    ),
    (
        "control character in name",
        yaml.safe_dump(GOOD),
        ["--set", 'name="a\\nb"'],
        ["--set name: must be a non-empty name without control characters"],
    ),
    ("empty name", yaml.safe_dump(GOOD), ["--set", "name=' '"], ["--set name: must be a non-empty name"]),
    # differential privacy and per-client evaluation
    (
        "negative clip",
        with_change("privacy", dict(PRIVATE, clip=-1.0)),
        [],
        ["exp.yaml: privacy.clip: must be a number > 0", "got -1.0"],
    ),
    (
        "delta of 1",
        yaml.safe_dump(dict(GOOD, privacy=PRIVATE)),
        ["--set", "privacy.delta=1"],
        ["--set privacy.delta: must be a number in (0, 1), got 1"],
    ),
    (
        "privacy without delta",
        with_change("privacy", {"clip": 1.0, "noise_multiplier": 1.0}),
        [],
        ["exp.yaml: privacy.delta: is required when privacy is on"],
    ),
    ("privacy not a mapping", with_change("privacy", 1.0), [], ["exp.yaml: privacy: expected a mapping"]),
    (
        "privacy with krum",
        yaml.safe_dump(dict(GOOD, privacy=PRIVATE, aggregator="krum", clients_per_round=4)),
        [],
        [
            "exp.yaml: privacy: aggregator krum cannot be used with differential privacy",
            "use aggregator fedavg or mean",
        ],
    ),
    (
        "privacy with scaffold",
        yaml.safe_dump(dict(GOOD, privacy=PRIVATE)),
        ["--set", "algorithm=scaffold"],
        ["privacy: algorithm scaffold cannot be used with differential privacy", "server state"],
    ),
    (
        "per-client evaluation without test split",
        with_change("eval_per_client", True),
        [],
        ["exp.yaml: eval_per_client: needs data.test_partition: true"],
    ),
    # client sampling and simulated system heterogeneity
    (
        "availability above 1",
        with_change("system.availability", 1.5),
        [],
        ["exp.yaml: system.availability: must be a probability in (0, 1], got 1.5"],
    ),
    (
        "negative deadline",
        yaml.safe_dump(GOOD),
        ["--set", "system.deadline=-1"],
        ["--set system.deadline: must be > 0 simulated seconds, or null for none, got -1.0"],
    ),
    (
        "power of choice without candidates",
        with_change("client_sampling", "power_of_choice"),
        [],
        ["exp.yaml: sampling_candidates: client_sampling power_of_choice needs d, the number of candidates"],
    ),
    (
        "too few candidates",
        with_change("client_sampling", "power_of_choice"),
        ["--set", "sampling_candidates=1"],
        ["--set sampling_candidates: must be >= clients_per_round (2)", "got 1"],
    ),
    (
        "unknown client sampling",
        with_change("client_sampling", "random"),
        [],
        ["exp.yaml: client_sampling: must be one of uniform, by_size, poisson, power_of_choice, got str 'random'"],
    ),
    (
        "unknown speed distribution",
        with_change("system.speed", {"gamma": 1}),
        [],
        ["exp.yaml: system.speed: unknown distribution 'gamma'; choose one of: lognormal, uniform"],
    ),
    (
        "unknown pre-aggregator given on the command line",
        yaml.safe_dump(GOOD),
        ["--set", "pre_aggregators=[nnm, foo]"],
        ["fedsim: error: --set pre_aggregators[1]: unknown pre-aggregator 'foo'"],
    ),
    (
        "an attack on the weights of an algorithm that sends none",
        with_change("attack", {"type": "sign_flip", "fraction": 0.5}),
        ["--set", "algorithm=fedproto"],
        ["exp.yaml: attack.type: algorithm fedproto exchanges no weights, so attack sign_flip"],
    ),
    (
        "compression of an algorithm that sends no weights",
        with_change("compression", {"type": "topk", "ratio": 0.1}),
        ["--set", "algorithm=fedproto"],
        ["exp.yaml: compression.type: algorithm fedproto exchanges no weights, so there is no update to compress"],
    ),
    (
        "a rule for an algorithm that sends no weights",
        yaml.safe_dump(GOOD),
        ["--set", "algorithm=fedproto", "--set", "aggregator=median"],
        [
            "fedsim: error: --set aggregator: algorithm fedproto exchanges no weights, so there is no weight update to "
            "aggregate; use aggregator: fedavg"
        ],
    ),
    (
        "a server optimizer for an algorithm that sends no weights",
        yaml.safe_dump(GOOD),
        ["--set", "algorithm=fedproto", "--set", "server_optimizer=fedadam"],
        ["fedsim: error: --set server_optimizer: algorithm fedproto exchanges no weights"],
    ),
    (
        "a key missing from a section given on the command line",
        yaml.safe_dump(GOOD),
        ["--set", "privacy.clip=1.0", "--set", "privacy.noise_multiplier=1.0"],
        ["fedsim: error: --set privacy.delta: is required when privacy is on"],
    ),
    # where the k and f a rule refuses come from
    (
        "attack.count past krum's f",
        with_change("attack", {"type": "ipm", "count": 2}),
        ["--set", "aggregator=krum"],
        [
            # options nobody set, refused for the rule the --set chose: said of that --set
            "fedsim: error: --set aggregator: aggregator_options: f = 2 is too large for k = 4 clients per round: "
            "Krum needs k > 2f + 2",
            "(k is clients_per_round 2 plus attack.count 2, and f is attack.count where the options set none)",
        ],
    ),
    (
        "bucketing leaves too few rows",
        with_change("pre_aggregators", [{"bucketing": {"s": 2}}]),
        ["--set", "aggregator=trimmed_mean", "--set", "aggregator_options={f: 1}"],
        [
            "f = 1 is too large for k = 1 clients per round",
            "(the pre-aggregators make 1 row of the 2 updates for the rule)",
        ],
    ),
    (
        "unknown system key",
        with_change("system.deadlines", 5),
        [],
        ["exp.yaml: system.deadlines: unknown key", "did you mean 'system.deadline'"],
    ),
]


@pytest.mark.parametrize("text, args, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_with_status_2(tmp_path, capsys, text, args, fragments):
    path = tmp_path / "exp.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / "run"), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedsim: error: ") and len(err) < 600, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not (tmp_path / "run").exists()  # nothing half-made is left behind


def test_an_output_directory_with_files_is_refused_unless_overwrite(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(taken)])
    assert exit_info.value.code == 2
    assert f"--out {taken}: directory exists and is not empty; pass --overwrite" in capsys.readouterr().err
    with pytest.raises(FedsimError, match="^out .*: directory exists and is not empty; pass overwrite=True to"):
        fedsim.run(str(path), out=taken)  # in fedsim.run's own words
    assert (taken / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_on_a_machine_without_it(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text(with_change("device", "cuda"))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "device: 'cuda' asked for, but CUDA is not available here" in err and err.count("\n") == 1


@pytest.mark.slow
def test_the_real_command_prints_no_traceback_and_debug_does(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(with_change("rounds", "ten"))
    plain = subprocess.run([sys.executable, "-m", "fedsim", "run", str(path)], capture_output=True, text=True)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert plain.stderr.strip().endswith("rounds: expected an integer, got str 'ten'")
    debug = subprocess.run(
        [sys.executable, "-m", "fedsim", "--debug", "run", str(path)], capture_output=True, text=True
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr


# ----------------------------------------------------------------------------- ranks started by hand


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 with WORLD_SIZE=2: no such rank; the ranks of this job are 0 to 1"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one': expected a whole number"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "FEDSIM_RENDEZVOUS_TIMEOUT": "soon"},
            "FEDSIM_RENDEZVOUS_TIMEOUT='soon': expected a number of seconds above 0",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "3", "FEDSIM_RENDEZVOUS_TIMEOUT": "0.3"},
            "rank 0: ranks 1, 2 of 3 (WORLD_SIZE) did not join within 0.3 s (FEDSIM_RENDEZVOUS_TIMEOUT)",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "FEDSIM_RENDEZVOUS_TIMEOUT": "0.3"},
            "rank 1: nothing answers at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} within 0.3 s",
        ),
    ],
    ids=["rank beyond the world", "rank not a number", "bad bound", "missing ranks", "no rank 0"],
)
def test_a_rank_that_cannot_join_is_one_line_at_once_or_within_the_bound(tmp_path, capsys, monkeypatch, env, fragment):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    port = free_port()
    for name, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and time.monotonic() - t0 < 5  # the 0.3 s bound, not the default 600 s
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment.format(port=port) in err, err
    assert not (tmp_path / "run").exists()


def test_ranks_given_different_world_sizes_are_refused_at_once(tmp_path, capsys, monkeypatch):
    """Each rank would wait for its own set of peers, and those that found theirs would wait in
    vain: the first rank that sees another's WORLD_SIZE says so."""
    from torch.distributed import TCPStore

    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    port = free_port()
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)

    def rank_1_of_3():
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        store.set("fedsim/0/joined/1", f"{socket.gethostname()} {os.getpid()} 3")

    peer = threading.Thread(target=rank_1_of_3, daemon=True)
    peer.start()
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and time.monotonic() - t0 < 30  # not the 600 s rendezvous bound
    err = capsys.readouterr().err
    assert err == (
        "fedsim: error: rank 0: rank 1 was started with WORLD_SIZE=3 and this rank with 2; start every rank "
        "with the same WORLD_SIZE (and --ranks, --nodes)\n"
    )


def test_a_run_without_workers_starts_no_fork_server(tmp_path):
    """The fork server imports torch for the workers; a run or sweep that will have none (its file,
    its run directory's config.yaml, --set or --grid says workers: 0) does not start it, and
    anything unclear does."""
    from argparse import Namespace

    from fedsim.cli.commands import _fork_server_imports

    (tmp_path / "none.yaml").write_text(yaml.safe_dump(GOOD))
    (tmp_path / "two.yaml").write_text(yaml.safe_dump({**GOOD, "workers": 2}))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(GOOD))

    def may(config=None, resume=None, *sets):
        return _fork_server_imports(Namespace(config=config, resume=resume, set=list(sets))) is not None

    assert not may(str(tmp_path / "none.yaml"))
    assert not may(None, str(tmp_path / "run"))
    assert not may(str(tmp_path / "two.yaml"), None, "workers=2", "workers=0")  # the last --set wins
    assert may(str(tmp_path / "none.yaml"), None, "workers=2")
    assert may(str(tmp_path / "two.yaml"))
    assert may("mnist_seed")  # a shipped experiment, by name: 4 workers
    assert may(str(tmp_path / "missing.yaml"))  # the run's own loading says what is wrong

    def sweep_may(config, grid, *sets):  # a sweep's grid point comes after its --set
        return _fork_server_imports(Namespace(config=config, grid=grid, set=list(sets))) is not None

    assert not sweep_may(str(tmp_path / "none.yaml"), ["aggregator=fedavg,median"])
    assert not sweep_may(str(tmp_path / "two.yaml"), ["workers=0"], "workers=2")
    assert sweep_may(str(tmp_path / "none.yaml"), ["workers=0,2"])
    assert sweep_may(str(tmp_path / "two.yaml"), ["seed=0,1"])


def test_the_fork_server_imports_what_any_run_of_the_command_needs(tmp_path):
    """Which language-model libraries the fork server imports is decided as each run decides it
    (worker_imports of its config), for every value of a --grid, not only the last."""
    from argparse import Namespace

    from fedsim.cli.commands import _fork_server_imports
    from fedsim.execution.processes import worker_imports
    from fedsim.experiment.validation import load_config

    (tmp_path / "lm.yaml").write_text(yaml.safe_dump({**GOOD, "workers": 2}))

    def imports(grid=(), *sets):
        return _fork_server_imports(Namespace(config=str(tmp_path / "lm.yaml"), grid=list(grid), set=list(sets)))

    assert imports() == []
    assert imports((), "lora.rank=8") == ["peft"]
    assert imports(["lora.rank=8,0"]) == ["peft"]  # the first grid value needs it, the last does not
    assert imports(["lora.rank=0,4"], "model=hf:gpt2") == ["peft", "transformers"]
    assert imports((), "lora={rank: 2}") == ["peft"]
    cfg = load_config({**GOOD, "model": "char_transformer", "lora": {"rank": 2, "target_modules": "qkv"}})
    assert worker_imports(cfg.to_dict()) == ["peft"]  # a run's own decision, from its loaded config


def test_a_ctrl_c_while_the_compiled_libraries_import_is_held_until_they_are_whole(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised inside a C extension's initialisation can be cleared there and the
    module left half made; the command imports them with the signal held, and raises it after."""
    from argparse import Namespace

    from fedsim.cli import commands

    (tmp_path / "lm.yaml").write_text(yaml.safe_dump({**GOOD, "lora": {"rank": 2}}))
    imported = []

    def import_module(name):
        if not imported:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the first one begins
            time.sleep(0.05)  # the handler runs here, between two bytecodes
        imported.append(name)

    monkeypatch.setattr(commands.importlib, "import_module", import_module)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            commands._import_whole(Namespace(config=str(tmp_path / "lm.yaml"), set=[]))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert imported == ["numpy", "torch", "peft"]
