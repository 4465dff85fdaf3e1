"""The "Every key" tables of docs/coordinator.md, generated from the config models (one source of truth).

    python -m sparrow.coordinator.config_docs            # rewrite the tables in docs/coordinator.md
    python -m sparrow.coordinator.config_docs --check    # exit 1 when they are out of date

`tests/test_coordinator_config.py` checks them, so a new or changed key cannot leave the docs behind.
"""

import copy
import json
import sys
from pathlib import Path

from pydantic import BaseModel

from sparrow.rollout_workers import registry

from .config import BASE, SparrowConfig, build_config, merge

DOC = Path(__file__).resolve().parents[1] / "docs" / "coordinator.md"
START, END = "<!-- every-key:start -->", "<!-- every-key:end -->"
MAX_DEFAULT = 60


def _shown(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value.replace("\n", "\\n")
    text = text if len(text) <= MAX_DEFAULT else text[: MAX_DEFAULT - 1] + "…"
    return f"`{text}`"


def _rows(model: BaseModel, prefix: str) -> list[tuple[str, str, str]]:
    """Every leaf key under `model` with its value in a file's defaults and its description."""
    rows = []
    for name, field in type(model).model_fields.items():
        key, value = f"{prefix}.{name}", getattr(model, name)
        if isinstance(value, BaseModel):
            rows += _rows(value, key)
            continue
        meaning = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append((key, _shown(value), meaning))
    for name, section in (model.__pydantic_extra__ or {}).items():  # the rollout backends' own sections
        rows += _rows(section, f"{prefix}.{name}")
    return rows


def tables() -> str:
    """One `####` section per top-level key, each a table of its dotted keys, defaults and meanings."""
    every_backend = {"rollout": {name: {} for name in registry.names()}}
    defaults = build_config(merge(copy.deepcopy(BASE), every_backend), "the defaults of a config file")
    out = []
    for name, field in SparrowConfig.model_fields.items():
        value = getattr(defaults, name)
        rows = _rows(value, name) if isinstance(value, BaseModel) else [(name, _shown(value), field.description or "")]
        out += [f"#### `{name}`", "", "| key | default | meaning |", "|---|---|---|"]
        out += [f"| `{k}` | {d} | {m} |" for k, d, m in rows]
        out.append("")
    return "\n".join(out)


def rewritten(text: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"{DOC}: the markers {START} and {END} around the Every key tables are missing")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n\n{tables()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = rewritten(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is out of date: run python -m sparrow.coordinator.config_docs", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
