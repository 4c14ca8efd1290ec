"""A small Dockerfile reader for the deploy tests: instructions per stage, with continuations joined."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON-array form (`["a", "b"]`); raises for the shell form."""
        value = json.loads(self.args)
        if not isinstance(value, list):
            raise ValueError(f"{self.keyword} is not in exec form: {self.args}")
        return value


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        """ENV key=value pairs of this stage (values unquoted, $VAR left as written)."""
        result: dict[str, str] = {}
        for inst in self.all("ENV"):
            for token in shlex.split(inst.args):
                key, _, value = token.partition("=")
                result[key] = value
        return result


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def _logical_lines(text: str) -> list[str]:
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current.strip():
            lines.append(current.strip())
        current = ""
    return lines


def parse(path: Path = DOCKERFILE) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text()):
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert match, f"cannot read FROM {args}"
            stages.append(Stage(match.group(1), match.group(2) or str(len(stages))))
        elif not stages and keyword == "ARG":
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, args))
    return Dockerfile(global_args, stages)
