"""Generated gRPC stubs for weightserver.v1 (from protos/ by scripts/gen_protos.py; never edit)."""
