"""Protocol frontends over `server.core`: `http` (FastAPI) and `grpc` (grpcio). They translate, nothing more."""
