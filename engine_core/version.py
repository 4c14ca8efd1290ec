"""Engine version, recorded in every plan; plans from another major.minor are refused."""

__version__ = "0.1.0"
PLAN_FORMAT_VERSION = 1
