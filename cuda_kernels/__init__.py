"""CUDA C kernel sources (one kernel family per .cu file), compiled at build time with NVRTC."""
