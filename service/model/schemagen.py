"""Generate the JSON Schemas of the Kafka events from the msgspec types.

The types in :mod:`service.model.events` are the source of truth; the checked-in
``schemas/*.schema.json`` are derived from them so that producers and consumers in other
languages can validate without reading Python. Output is deterministic (sorted keys,
2-space indent, trailing newline) so a drift shows up as a diff and ``--check`` (run by the
tests) fails until the files are regenerated::

    python -m service.model.schemagen           # write schemas/*.schema.json
    python -m service.model.schemagen --check   # exit 1 if they are out of date

``schemas/asyncapi.yaml`` is written by hand (it is mostly prose) and only refers to the
generated files.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from service.model.events import InputEvent, OutputEvent

__all__ = ["SCHEMAS", "SCHEMA_DIR", "check", "render", "write"]

SCHEMA_DIR: Final = Path(__file__).resolve().parents[2] / "schemas"
JSON_SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"

# File name -> (root type, title).
SCHEMAS: Final[dict[str, tuple[type[msgspec.Struct], str]]] = {
    "input-event.schema.json": (
        InputEvent,
        "Nova scheduling outcome (cortex.nova.scheduling_outcome.v1)",
    ),
    "classification-event.schema.json": (
        OutputEvent,
        "CR classification (cortex.crs.classification.v1)",
    ),
}


def _clean_descriptions(node: Any) -> Any:
    # msgspec copies class docstrings verbatim, indentation included.
    if isinstance(node, dict):
        return {
            k: inspect.cleandoc(v)
            if k == "description" and isinstance(v, str)
            else _clean_descriptions(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_clean_descriptions(v) for v in node]
    return node


def _inline_enums(schema: dict[str, Any]) -> dict[str, Any]:
    # msgspec puts an Enum in its own $defs entry (titled with the Python class name) behind
    # a $ref. The contract carries its closed value sets inline as a bare "enum", as it did
    # when they were Literal types: the Python class names are not the consumers' business,
    # and a value set must read the same whichever way the code spells it.
    defs: dict[str, Any] = schema.get("$defs", {})
    enums = {f"#/$defs/{name}": d["enum"] for name, d in defs.items() if "enum" in d}

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref in enums:
                return {**{k: v for k, v in node.items() if k != "$ref"}, "enum": enums[ref]}
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    out: dict[str, Any] = inline(schema)
    if "$defs" in out:
        out["$defs"] = {name: d for name, d in out["$defs"].items() if "enum" not in d}
    return out


def render(root: type[msgspec.Struct], title: str) -> str:
    """The schema document for ``root`` as deterministic JSON text."""
    schema = _clean_descriptions(_inline_enums(msgspec.json.schema(root)))
    schema["$schema"] = JSON_SCHEMA_DIALECT
    schema["title"] = title
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def rendered() -> dict[str, str]:
    """File name -> expected content, for every generated schema."""
    return {name: render(root, title) for name, (root, title) in SCHEMAS.items()}


def write(directory: Path = SCHEMA_DIR) -> list[Path]:
    """Write every schema into ``directory``; returns the files that changed."""
    changed: list[Path] = []
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in rendered().items():
        path = directory / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def check(directory: Path = SCHEMA_DIR) -> list[Path]:
    """The checked-in schema files that are missing or differ from the generated ones."""
    stale: list[Path] = []
    for name, text in rendered().items():
        path = directory / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            stale.append(path)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m service.model.schemagen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if files are out of date")
    parser.add_argument("--dir", type=Path, default=SCHEMA_DIR, help="schema directory")
    args = parser.parse_args(argv)
    if args.check:
        stale = check(args.dir)
        for path in stale:
            print(f"out of date: {path} (run python -m service.model.schemagen)", file=sys.stderr)
        return 1 if stale else 0
    for path in write(args.dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
