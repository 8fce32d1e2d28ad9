"""Reading experiment files: PyYAML's safe loader, bounded; the shipped experiments by name."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, cut

MAX_FILE_BYTES = 1 << 20  # an experiment file is a few hundred bytes; anything near this is not one
MAX_NODES = 10_000  # values in a document once its aliases are expanded
MAX_DEPTH = 32  # nesting of mappings and lists
# The experiments that come with fedsim: package data (in a checkout, a link to experiments/),
# so that `fedsim run mnist_seed` works from any directory once fedsim is installed.
SHIPPED = Path(__file__).parent.parent / "experiments"


class RefusedYAML(yaml.MarkedYAMLError):
    """Well-formed YAML that fedsim will not read: too deep, too large, or a key given twice."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: a few hundred bytes of aliases can expand into millions of
    values (which every later copy, dump or error message would then pay for), and deep nesting
    exhausts Python's recursion limit. Documents beyond MAX_DEPTH or MAX_NODES are refused, and
    so is a key given twice in one mapping, which PyYAML would silently resolve to the last."""

    def compose_node(self, parent, index):
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_DEPTH:
            raise RefusedYAML(
                problem=f"nested more than {MAX_DEPTH} levels deep", problem_mark=self.peek_event().start_mark
            )
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def construct_document(self, node):
        if _expanded_size(node) > MAX_NODES:
            raise RefusedYAML(
                problem=f"expands into more than {MAX_NODES:,} values (aliases included)", problem_mark=node.start_mark
            )
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` merges keys that the mapping may then override
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise RefusedYAML(
                        problem=f"key {cut(repr(key))} given twice in one mapping", problem_mark=key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)


# YAML 1.1 (PyYAML) reads 1e-3 as text; YAML 1.2 and every user read it as the number it means
_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _expanded_size(root) -> int:
    """Nodes of the document with every alias expanded; a recursive alias counts as unbounded.
    Iterative and memoized by node, so neither a long alias chain nor a wide one is costly."""
    size: dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size and not children_done:
            continue
        children = _children(node)
        if children_done:
            size[id(node)] = min(1 + sum(size.get(id(c), MAX_NODES + 1) for c in children), MAX_NODES + 1)
            continue
        size[id(node)] = MAX_NODES + 1  # in progress: a cycle back to it counts as too large
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)
    return size[id(root)]


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load`` within the bounds of ``_BoundedLoader``."""
    return yaml.load(text, Loader=_BoundedLoader)


def shipped_experiments() -> dict[str, str]:
    """Name (``mnist_seed``, ``compare/base``) -> the question its leading comment asks (its
    first sentence)."""
    found = {}
    for path in sorted(SHIPPED.rglob("*.yaml")):
        words = []
        for line in path.read_text().splitlines():
            text = line.lstrip("#").strip()
            if not line.startswith("#") or not text:
                break
            words.append(text)
        comment = " ".join(words)
        end = re.search(r"\?|(?<! al)\.(\s|$)", comment)  # its question, or its first sentence
        found[path.relative_to(SHIPPED).with_suffix("").as_posix()] = comment[: end.start() + 1] if end else comment
    return found


def experiment_file(spec: str | os.PathLike) -> Path:
    """The file an experiment argument names: a path that exists, else a shipped experiment by
    name (``mnist_seed``, ``mnist_seed.yaml``, ``compare/base``, or ``experiments/mnist_seed.yaml``
    as the documentation spells it), else the path as given (reading it then says it is not found)."""
    path = Path(spec)
    if path.exists():
        return path
    name = path.as_posix().removeprefix("experiments/").removesuffix(".yaml")
    shipped = SHIPPED / f"{name}.yaml"
    if ".." not in Path(name).parts and shipped.is_file():
        return shipped
    return path


def read_yaml(path: Path) -> dict:
    try:
        if path.is_file() and path.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(
                f"{path}: {path.stat().st_size:,} bytes is too large for an experiment file "
                f"(at most {MAX_FILE_BYTES:,})"
            )
        text = path.read_text()
    except FileNotFoundError:
        names = list(shipped_experiments())
        close = difflib.get_close_matches(path.as_posix().removesuffix(".yaml"), names, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ConfigError(
            f"{path}: file not found; {hint}fedsim list shows the {len(names)} shipped experiments"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a YAML experiment file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    try:
        raw = parse_yaml(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown line"
        kind = "refused" if isinstance(e, RefusedYAML) else "syntax error"
        raise ConfigError(f"{path}: YAML {kind} at {where}: {e.problem or e.context}") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer of more digits than Python converts
        raise ConfigError(f"{path}: YAML error: {cut(' '.join(str(e).split()), 200)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(raw).__name__}")
    return raw
