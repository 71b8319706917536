"""One planted bug: the rule it breaks, where (a snippet of one module), and the tests that must notice."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str
    file: str           # under src/k3_accel/
    old: str
    new: str
    tests: tuple[str, ...]
    venv: str = ".venv"  # the environment whose python runs the tests

    @property
    def module(self) -> str:
        return self.file.removesuffix(".py").replace("/", ".")
