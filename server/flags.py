"""Flag value types shared by the modules that add `kiln serve` flags (cli, tls)."""

from __future__ import annotations

import argparse


def parse_bool(text: str) -> bool:
    """Triton's boolean flag values: true/false, 1/0, yes/no, on/off."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got '{text}'")
