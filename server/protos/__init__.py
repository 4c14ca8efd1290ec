"""Generated protobuf and gRPC code for Kiln's protocols (see tools/gen_protos.py)."""
