"""specdraft client: the CLI, typed gRPC clients, discovery, the local stack and the benchmarks."""
