"""Writing a benchmark's JSON document: printed, and to ``--out`` when given."""
from __future__ import annotations

import json
from pathlib import Path


def emit(doc: dict, out: str | None) -> None:
    text = json.dumps(doc, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
