"""Exceptions with messages meant for users: each names the tensor, layer or file at fault."""


class KilnError(Exception):
    """Base class of every error Kiln raises on purpose."""


class ParseError(KilnError):
    """An ONNX model could not be imported (unsupported op, malformed graph, ...)."""


class BuildError(KilnError):
    """A network could not be turned into a plan."""


class PlanFormatError(KilnError):
    """A plan file is corrupt, truncated or was built for another engine version or backend."""


class ShapeError(KilnError):
    """An input shape is outside the active optimization profile or inconsistent with the model."""


class ExecutionError(KilnError):
    """A layer failed while the plan ran."""


class DeviceMemoryError(KilnError):
    """An engine does not fit the device's free memory (its message gives the bytes needed and free)."""
