"""Every code block of README.md and docs/ works as it is written, every link of theirs leads
somewhere, and the pages build as a site. A Python block is a whole program (imports, data, the
``__main__`` guard) and runs; a YAML block is a config section that loads; the fedsim commands
of a bash block parse, and the experiment, keys and values they name load (running them is the
experiments themselves: hours); a text block is a diagram."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

from fedsim.cli import build_parser
from fedsim.experiment.validation import load_config
from fedsim.runs.sweep import plan

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def code_blocks(path: Path) -> list[tuple[str, str, str]]:
    """(where, language, text) of every fenced block of a markdown file."""
    text = path.read_text()
    return [
        (f"{path.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}", m.group(1), m.group(2))
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    ]


BLOCKS = [block for path in DOCS for block in code_blocks(path)]


def blocks(language: str):
    return [pytest.param(text, id=where) for where, lang, text in BLOCKS if lang == language]


def test_every_block_says_what_it_is():
    assert {lang for _, lang, _ in BLOCKS} <= {"python", "bash", "yaml", "text"}, [
        (where, lang) for where, lang, _ in BLOCKS if lang not in ("python", "bash", "yaml", "text")
    ]
    assert len(blocks("python")) >= 6 and len(blocks("bash")) >= 15


SHOWN = ("def clipped_mean", "def drop_longest")  # the examples whose printed figures the page quotes


@pytest.mark.slow
@pytest.mark.parametrize("program", [p for p in blocks("python") if not any(s in p.values[0] for s in SHOWN)])
def test_a_python_block_runs_as_a_program(program, tmp_path):  # the rule's example runs below
    done = _run_program(program, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("shown", SHOWN)
def test_the_rule_and_pre_aggregator_examples_show_their_effect(tmp_path, shown):
    """The rule and the pre-aggregator of docs/extending.md, each run beside what it changes,
    print what the page says they print, and the two lines differ."""
    page = (REPO / "docs" / "extending.md").read_text()
    (program,) = [text for text in (p.values[0] for p in blocks("python")) if shown in text]
    done = _run_program(program, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    fedavg, clipped = done.stdout.strip().splitlines()[-2:]
    said = f"It prints `{fedavg}` and `{clipped}`"
    assert " ".join(said.split()) in " ".join(page.split())
    assert fedavg.split(None, 1)[1] != clipped.split(None, 1)[1]


def _run_program(program: str, folder: Path) -> subprocess.CompletedProcess:
    (folder / "example.py").write_text(program)
    env = {k: v for k, v in os.environ.items() if k != "FEDSIM_DATA"}  # generated data only: nothing to fetch
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "example.py"], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )


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
            assert words[0] in (
                "pip",
                "python",
                "export",
                "head=$(scontrol",
                "srun",
                "rsync",
                "ssh",
                "papermill",
            ) or words[:2] == ["python", "-m"], words


def _commands(script: str) -> list[list[str]]:
    """The commands of a shell script, continuation lines joined, comments dropped."""
    joined = script.replace("\\\n", " ")
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def _check_fedsim(args: list[str]) -> None:
    parsed = build_parser().parse_args(args)  # a wrong flag exits (SystemExit fails the test)
    if parsed.command == "run" and not parsed.resume or parsed.command == "partition":
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


def _prose(path: Path) -> list[str]:
    """The lines of a markdown file outside its fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """A heading's anchor as mkdocs makes it (Python-Markdown's toc): the text without markup,
    ASCII only, lower case, punctuation dropped, spaces and hyphens joined into one hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in _prose(path):
        if heading := re.match(r"#{1,6}\s+(.*?)\s*#*$", line):
            slug, n = _slug(heading.group(1)), 0
            while (slug if n == 0 else f"{slug}_{n}") in found:  # a repeated heading gets _1, _2, ...
                n += 1
            found.add(slug if n == 0 else f"{slug}_{n}")
    return found


def _links(path: Path) -> list[str]:
    """The targets of the markdown links of a file, outside code."""
    return [
        target
        for line in _prose(path)
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line))
    ]


def test_the_slugs_are_those_of_mkdocs():
    """On examples, and on every heading of the pages, against Python-Markdown's own toc."""
    import markdown

    headings = [m.group(1) for path in DOCS for line in _prose(path) if (m := re.match(r"#{1,6}\s+(.*)", line))]
    assert len(headings) > 40
    for heading in headings:
        made = re.search(r'id="([^"]*)"', markdown.markdown(f"## {heading}", extensions=["toc"])).group(1)
        assert _slug(heading) == made, heading
    assert _slug("Aggregation rules") == "aggregation-rules"
    assert _slug("System heterogeneity and client sampling") == "system-heterogeneity-and-client-sampling"
    assert (
        _slug("Per-client evaluation (`eval_per_client`, `data.test_partition`)")
        == "per-client-evaluation-eval_per_client-datatest_partition"
    )
    assert _slug("Scaling: GPUs / machines — «fast»") == "scaling-gpus-machines-fast"


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_every_relative_link_and_anchor_resolves(path):
    """A link to a file of the checkout names one that exists, and its #anchor a heading there;
    links stay inside docs/ so that they work on GitHub and on the site alike (the README's
    links into docs/ become the site home page's)."""
    links = [link for link in _links(path) if not re.match(r"[a-z]+:", link)]
    for link in links:
        file, _, anchor = link.partition("#")
        target = (path.parent / file).resolve() if file else path
        assert target.is_file(), f"{path.relative_to(REPO)}: {link}: no such file"
        assert target.is_relative_to(REPO / "docs"), f"{path.relative_to(REPO)}: {link}: outside docs/"
        if anchor:
            assert target.suffix == ".md" and anchor in _anchors(target), (
                f"{path.relative_to(REPO)}: {link}: no heading with that anchor in {target.name}"
            )


def test_the_readme_indexes_every_page():
    linked = {link.partition("#")[0] for link in _links(REPO / "README.md")}
    assert {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} <= linked


def test_every_page_is_in_the_site_navigation():
    def pages(nav):
        for entry in nav:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                yield from pages(value) if isinstance(value, list) else [value]

    listed = list(pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]))
    on_disk = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert sorted(listed) == sorted(on_disk | {"index.md"})  # index.md: the README, made the home page


def test_the_readme_sets_up_as_ci_does():
    """The Set-up section's one shell block is exactly the two commands CI runs."""
    readme = (REPO / "README.md").read_text()
    setup = readme.split("\n## Set-up\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^```(\w*)\n(.*?)^```", setup, re.M | re.S) == [
        ("bash", 'pip install -e ".[dev]"\npython -m pytest\n')
    ]
    # before the command that downloads it: the CUDA build of torch, and how to get the CPU build instead
    before = setup.split("```bash", 1)[0]
    assert "CUDA build: a download\nof about 5 GB" in before
    assert "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu" in before
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert 'pip install -e ".[dev]"' in ci and "python -m pytest" in ci


@pytest.mark.slow
def test_the_site_builds_in_strict_mode(tmp_path):
    """mkdocs builds the pages with the README as home page and the API reference from the
    docstrings; strict mode fails on any warning: a broken link or anchor, a page left out of
    the navigation, a docstring it cannot read."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(REPO / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Quick start" in home and 'href="getting-started/#set-up"' in home
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Run an experiment and return its History" in api and "load_model" in api


def test_the_experiments_table_lists_every_shipped_file():
    """docs/configuration.md's table of experiment files names every file the package ships (a cell
    names its first file from the repository root, the others from experiments/)."""
    text = (REPO / "docs" / "configuration.md").read_text()
    table = text.split("| file | question |", 1)[1].split("\n\n", 1)[0]
    listed = set()
    for line in table.splitlines()[2:]:
        cell = line.split("|")[1]
        listed |= {name.removeprefix("experiments/") for name in re.findall(r"`([^`]+\.yaml)`", cell)}
    shipped = {str(p.relative_to(REPO / "experiments")) for p in (REPO / "experiments").rglob("*.yaml")}
    assert listed == shipped, (sorted(shipped - listed), sorted(listed - shipped))
