"""The generated gRPC stubs (package ``specdraft.v1``), failing loudly when they are missing."""

from __future__ import annotations

try:
    from specdraft.v1 import (
        common_pb2,
        datastore_pb2,
        datastore_pb2_grpc,
        generation_pb2,
        generation_pb2_grpc,
    )
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(
        "the gRPC stubs (specdraft.v1) are not generated: run `make setup`, "
        "or `python client/build_stubs.py` and reinstall the package"
    ) from exc

__all__ = ["common_pb2", "datastore_pb2", "datastore_pb2_grpc", "generation_pb2", "generation_pb2_grpc"]
