"""gRPC frontend: Triton's `inference.GRPCInferenceService` (wire-compatible with stock `tritonclient.grpc`)."""

from .options import GrpcOptions
from .server import start_grpc_server

__all__ = ["GrpcOptions", "start_grpc_server"]
