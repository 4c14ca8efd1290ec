"""Triton's repository agents that Kiln runs: the checksum agent, which checks a model's files before it loads.

Triton's `checksum` agent (shipped in its containers) reads `model_repository_agents { agents [{ name: "checksum"
parameters { key: "MD5:1/model.onnx" value: "<hex digest>" } }] }`: each key is the hash algorithm and a file
relative to the model's directory, each value the digest the file must have, and a mismatch fails the load. Kiln
does the same, so a repository that relies on it keeps its protection; agents of other names are refused
(config_fields).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from server.protos import model_config_pb2

from .errors import invalid
from .limits import check_relative_path

#: the agents Kiln runs, by the name a config gives them
AGENTS = ("checksum",)
#: the algorithms of the checksum agent's keys (Triton's: MD5)
ALGORITHMS = {"MD5": hashlib.md5}

_CHUNK = 1 << 20


def supported(config: model_config_pb2.ModelConfig) -> bool:
    """Whether every agent the config names is one Kiln runs (config_fields' PARTLY rule)."""
    return all(agent.name in AGENTS for agent in config.model_repository_agents.agents)


def run_agents(config: model_config_pb2.ModelConfig, model_dir: Path) -> None:
    """Before a load: each checksum entry's file has its digest; INVALID_ARGUMENT naming the model, the file and
    both digests when it does not (or when the entry is malformed or names a file outside the model directory)."""
    for agent in config.model_repository_agents.agents:
        if agent.name not in AGENTS:  # refused at the config check (ignored, with a warning, under --lenient-config)
            continue
        for key, expected in sorted(agent.parameters.items()):
            algorithm, _, relative = key.partition(":")
            where = f"model '{config.name}': checksum agent parameter '{key}'"
            if algorithm.upper() not in ALGORITHMS or not relative:
                raise invalid(f"{where}: expected '<algorithm>:<file>' with algorithm {sorted(ALGORITHMS)}")
            check_relative_path(relative, f"{where}: file")
            path = model_dir / relative
            if not path.is_file():
                raise invalid(f"{where}: '{relative}' is not a file in {model_dir}")
            actual = _digest(path, algorithm.upper())
            if actual != expected.strip().lower():
                raise invalid(f"{where}: '{relative}' has {algorithm.upper()} {actual}, the config expects "
                              f"{expected.strip().lower()}; the file changed or the config is stale")


def _digest(path: Path, algorithm: str) -> str:
    digest = ALGORITHMS[algorithm]()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()
