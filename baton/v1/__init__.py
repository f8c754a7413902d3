"""Generated protobuf and gRPC code for `proto/baton/v1/*.proto`; regenerate with `python -m baton.protogen`."""
