"""fedsim without a checkout: the shipped experiments found by name, the version, and the built
wheel installed into an empty folder and run from an empty directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import fedsim
from fedsim.cli import main
from fedsim.core.errors import ConfigError
from fedsim.core.yamlfile import SHIPPED, experiment_file, shipped_experiments
from fedsim.experiment.validation import load_config

REPO = Path(__file__).resolve().parent.parent


def test_shipped_experiments_are_the_experiments_folder():
    on_disk = sorted(
        p.relative_to(REPO / "experiments").with_suffix("").as_posix() for p in (REPO / "experiments").rglob("*.yaml")
    )
    assert sorted(shipped_experiments()) == on_disk
    assert shipped_experiments()["mnist_seed"].endswith("learn in 3 rounds?")


@pytest.mark.parametrize("spelled", ["mnist_seed", "mnist_seed.yaml", "experiments/mnist_seed.yaml"])
def test_an_experiment_is_found_by_name_from_any_directory(spelled, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert experiment_file(spelled) == SHIPPED / "mnist_seed.yaml"
    assert load_config(spelled).name == "mnist_seed"
    assert experiment_file("compare/base") == SHIPPED / "compare" / "base.yaml"


def test_a_path_that_exists_comes_before_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mnist_seed").write_text(yaml.safe_dump({"name": "mine"}))
    assert load_config("mnist_seed").name == "mine"


def test_a_missing_file_names_the_shipped_experiments_it_is_close_to(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config("mnist_sed")
    shipped = len(shipped_experiments())
    assert str(e.value).startswith("mnist_sed: file not found; did you mean mnist_seed")  # the closest first
    assert str(e.value).endswith(f"? fedsim list shows the {shipped} shipped experiments")
    with pytest.raises(ConfigError) as e:
        load_config("nothing/like/it.yaml")
    assert str(e.value) == f"nothing/like/it.yaml: file not found; fedsim list shows the {shipped} shipped experiments"
    with pytest.raises(ConfigError):
        load_config("../experiments/mnist_seed")  # a name stays inside the shipped folder


def test_list_shows_the_experiments_and_version_the_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["list"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("experiments (fedsim run NAME):\n")
    assert "  mnist_seed " in out and "\ndatasets:\n" in out
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"fedsim {fedsim.__version__}\n"


@pytest.mark.slow
def test_the_built_wheel_runs_a_shipped_experiment_from_an_empty_directory(tmp_path):
    """Build the wheel from a copy of the sources, install it without dependencies into an empty
    folder, and run one round of mnist_seed on generated data from an empty directory with only
    that folder on the path."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("fedsim", "experiments"):
        shutil.copytree(REPO / name, source / name, symlinks=True, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("fedsim_sync-*.whl")
    target, empty = tmp_path / "site", tmp_path / "empty"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    empty.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDSIM_DATA")}, "PYTHONPATH": str(target)}

    def fedsim_command(*args):
        return subprocess.run(
            [str(target / "bin" / "fedsim"), *args], cwd=empty, env=env, capture_output=True, text=True, timeout=300
        )

    where = subprocess.run(
        [sys.executable, "-c", "import fedsim; print(fedsim.__file__)"],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert Path(where.strip()).is_relative_to(target), where
    assert fedsim_command("--version").stdout == f"fedsim {fedsim.__version__}\n"
    done = fedsim_command(
        "run",
        "mnist_seed",
        "--set",
        "data.dataset=synthetic",
        "--set",
        "rounds=1",
        "--set",
        "device=cpu",
        "--set",
        "workers=2",
        "--out",
        "runs/first",
    )
    assert done.returncode == 0, done.stderr
    assert "final test accuracy" in done.stdout and "runs/first" in done.stdout
    assert (empty / "runs" / "first" / "metrics.csv").is_file()
    assert sorted(p.name for p in empty.iterdir()) == ["runs"]  # nothing else was written there


def test_list_names_the_lora_methods_the_tokenizers_and_the_hf_loaders(capsys):
    from fedsim.cli import main

    with pytest.raises(SystemExit) as end:
        main(["list"])
    assert end.value.code == 0
    out = capsys.readouterr().out
    assert "LoRA methods (lora.method):\n  fedit" in out and "\n  ffa " in out
    assert "tokenizers (data.tokenizer):\n  bytes" in out
    for form in ("data.dataset: hf:<name or folder>", "model: hf:<name or folder>", "data.tokenizer: hf:<name"):
        assert f"\n  {form}" in out, form
