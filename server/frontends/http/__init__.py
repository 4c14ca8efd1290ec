"""HTTP/REST frontend: KServe v2 + Triton extensions (wire-compatible with stock `tritonclient.http`)."""

from .app import create_app

__all__ = ["create_app"]
