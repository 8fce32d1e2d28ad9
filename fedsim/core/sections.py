"""How a config section is declared: one dataclass beside the feature it configures, each key one
``option`` that says its default, its line in the docs and, where the key is read only in some
runs, when it is not.

Everything that lists a section's keys comes from that one declaration:

- the typed reading of an experiment file, with its refusal of an unknown key
  (``experiment/reading.py``'s ``build``: the dataclass's fields and their types);
- the section's checks: its ``check()`` method, which validation calls for every section;
- the warning for a key set but not read (``unused``: the option's ``unread``);
- the key table of ``docs/configuration.md`` and ``fedsim list keys`` (``key_rows``).

A new key of an existing section is one ``option`` line in its dataclass (and its check, if its
values are bounded).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

# (key, the section, the whole config) -> why the key is not read in this run, or None when it is
Unread = Callable[[str, Any, Any], "str | None"]
_MISSING = dataclasses.MISSING


def option(
    default: Any = _MISSING,
    doc: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    unread: Unread | None = None,
    shown_default: str | None = None,
    required: bool = False,
) -> Any:
    """A key of a section: its ``default`` (or a ``factory`` of it), what it means (``doc``, one
    Markdown line, as the docs' key table shows it), ``unread`` (see ``Unread``) and, where the
    default is not a plain value, how the table shows it (``shown_default``). A ``required`` key
    has no default (None) and must be given whenever its section is."""
    shown = "required" if required else shown_default
    metadata = {"doc": doc, "unread": unread, "shown_default": shown, "required": required}
    if required:
        default = None  # the section's check says that it is missing, by name
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def required_keys(cls: type) -> tuple[str, ...]:
    """The keys of a section class that have no default."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("required"))


def is_section(value: object) -> bool:
    """A section instance: a dataclass declared by ``option``s (not a plain value, nor another
    dataclass given as a value, such as a Dataset)."""
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and all("doc" in f.metadata for f in dataclasses.fields(value))
    )


def sections(config: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, section) of ``config`` and of every section inside it, outermost first;
    the top level's name is ""."""
    yield prefix.rstrip("."), config
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if is_section(value):
            yield from sections(value, f"{prefix}{f.name}.")


def unused(config: Any) -> list[str]:
    """One line for every key of every section that is set to other than its default although
    this run does not read it (its option's ``unread`` gives the reason)."""
    lines = []
    for name, section in sections(config):
        default = type(section)()
        for f in dataclasses.fields(section):
            value, unread = getattr(section, f.name), f.metadata.get("unread")
            if unread is None or is_section(value) or value == getattr(default, f.name):
                continue
            reason = unread(f.name, section, config)
            if reason:
                lines.append(f"{name + '.' if name else ''}{f.name} is {value!r} but {reason}")
    return lines


def key_rows(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(dotted key, default as the docs show it, doc) for every key of the section class ``cls``
    and of the sections inside it (an optional one too, such as ``privacy``), in declaration
    order; a section's keys follow the keys of the level above."""
    hints, nested = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        inner = section_type(hints[f.name])
        if inner is not None:
            nested.append((f.name, inner))
            continue
        shown = f.metadata.get("shown_default")
        if shown is None:
            shown = f"`{_yaml(f.default if f.default_factory is _MISSING else f.default_factory())}`"
        yield f"{prefix}{f.name}", shown, f.metadata.get("doc", "")
    for name, section in nested:
        yield from key_rows(section, f"{prefix}{name}.")


def section_type(hint: Any) -> type | None:
    """The section class a field's type names (``LoraConfig``, or ``PrivacyConfig | None``), or None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next((a for a in typing.get_args(hint) if a is not type(None)), None)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _yaml(value: object) -> str:
    """A default as an experiment file writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == {}:
        return "{}"
    return f"{value:g}" if isinstance(value, float) else str(value)
