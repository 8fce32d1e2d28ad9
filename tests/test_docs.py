"""Every code block of README.md and docs/ works as it is written. A Python block is a whole
program (imports, data, the ``__main__`` guard) and runs; a YAML block is a config section that
loads; the fedsim commands of a bash block parse, and the experiment, keys and values they name
load (running them is the experiments themselves: hours); a text block is a diagram."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedsim.cli import build_parser
from fedsim.sweep import plan
from fedsim.validation import load_config

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def code_blocks(path: Path) -> list[tuple[str, str, str]]:
    """(where, language, text) of every fenced block of a markdown file."""
    text = path.read_text()
    return [(f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}", m.group(1), m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


BLOCKS = [block for path in DOCS for block in code_blocks(path)]


def blocks(language: str):
    return [pytest.param(text, id=where) for where, lang, text in BLOCKS if lang == language]


def test_every_block_says_what_it_is():
    assert {lang for _, lang, _ in BLOCKS} <= {"python", "bash", "yaml", "text"}, \
        [(where, lang) for where, lang, _ in BLOCKS if lang not in ("python", "bash", "yaml", "text")]
    assert len(blocks("python")) >= 6 and len(blocks("bash")) >= 15


@pytest.mark.slow
@pytest.mark.parametrize("program", [p for p in blocks("python") if "def clipped_mean" not in p.values[0]])
def test_a_python_block_runs_as_a_program(program, tmp_path):  # the rule's example runs below
    done = _run_program(program, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_rule_example_shows_its_effect(tmp_path):
    """The README's own rule, paired with its experiment, prints what the README says it prints,
    and that differs from FedAvg's numbers."""
    readme = (REPO / "README.md").read_text()
    (program,) = [text for text in (p.values[0] for p in blocks("python")) if "def clipped_mean" in text]
    done = _run_program(program, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    fedavg, clipped = done.stdout.strip().splitlines()[-2:]
    said = f"It prints `{fedavg}` and `{clipped}`"
    assert " ".join(said.split()) in " ".join(readme.split())
    assert fedavg.split(None, 1)[1] != clipped.split(None, 1)[1]


def _run_program(program: str, folder: Path) -> subprocess.CompletedProcess:
    (folder / "example.py").write_text(program)
    env = {k: v for k, v in os.environ.items() if k != "FEDSIM_DATA"}  # generated data only: nothing to fetch
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "example.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("section", blocks("yaml"))
def test_a_yaml_block_is_a_section_that_loads(section):
    load_config(yaml.safe_load(section))


@pytest.mark.parametrize("script", blocks("bash"))
def test_the_commands_of_a_bash_block_parse_and_name_what_loads(script, monkeypatch):
    monkeypatch.chdir(REPO)
    for words in _commands(script):
        if words[0] == "python" and words[1].startswith("benchmarks/"):
            _check_benchmark(words[1], words[2:])
        elif "fedsim" in words:
            start = words.index("fedsim") + 1  # `fedsim ...`, `python -m fedsim ...`, `torchrun ... -m fedsim ...`
            _check_fedsim(words[start:])
        else:
            assert words[0] in ("pip", "python", "export", "head=$(scontrol", "srun", "rsync", "ssh") or \
                words[:2] == ["python", "-m"], words


def _commands(script: str) -> list[list[str]]:
    """The commands of a shell script, continuation lines joined, comments dropped."""
    joined = script.replace("\\\n", " ")
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def _check_fedsim(args: list[str]) -> None:
    parsed = build_parser().parse_args(args)  # a wrong flag exits (SystemExit fails the test)
    if parsed.command == "run" and not parsed.resume:
        load_config(parsed.config, parsed.set)
    elif parsed.command == "partition":
        load_config(parsed.config, parsed.set)
    elif parsed.command == "sweep":
        plan(parsed.config, parsed.grid, parsed.set, parsed.seeds)


def _check_benchmark(script: str, flags: list[str]) -> None:
    path = REPO / script
    sys.path.insert(0, str(path.parent))  # the scripts import their harness as a sibling
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.parse_args(flags)
    finally:
        sys.path.remove(str(path.parent))
