"""Execution backends: each turns plan layers into runnable steps."""
