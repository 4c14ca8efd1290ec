"""Example Kiln plugins (custom ONNX-domain ops written in Python)."""
