"""The one reader of a GGUF header's scalar fields (gguf-py's ``GGUFReader.fields``), for every part of an import that
reads them: the source's architecture, size label and file type (swarm.store.gguf_source), the configs of the families
mapped here (swarm.store.gguf_names) and the MoE families' expert counts (swarm.store.gguf_moe).

gguf-py keeps a field as its raw parts: ``field.types[0]`` says its type, ``field.parts[field.data[0]]`` holds its
value -- a string's bytes, or a one-element array of the number. A field that is missing, an array, or not of the kind
asked reads as None, and the caller falls back to its default (it is a file from elsewhere, never trusted to be
well-formed).
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

Scalar = str | int | float | bool
_T = TypeVar("_T", str, int, float, bool)


def header_value(reader: Any, key: str) -> Scalar | None:
    """The scalar field ``key`` of a GGUF's header as its own type: str, int, float or bool; None where the header has
    none, it is an array, or a string that is not UTF-8."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.data or not field.types or field.types[0] == GGUFValueType.ARRAY:
        return None
    part = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        try:
            return bytes(part).decode()
        except UnicodeDecodeError:
            return None
    return cast(Scalar, part[0].item())


def header_field(reader: Any, key: str, kind: type[_T]) -> _T | None:
    """The field ``key`` as ``kind``: a string as str; a number (or a bool) as int, float or bool. None where
    :func:`header_value` has none, or the field is a string asked as a number or a number asked as a string."""
    value = header_value(reader, key)
    if value is None or isinstance(value, str) != (kind is str):
        return None
    return kind(value)
