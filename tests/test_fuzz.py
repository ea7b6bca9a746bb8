"""Fuzzing every RPC of both services (issue 12): generated messages (every field of the request
type, values from the edges of each type) and mutated ones (a valid message's bytes flipped,
cut or extended), sent to a real worker and a real shard on loopback.

Every answer must be OK or a precise status — never UNKNOWN (an exception gRPC wrapped), never a
crash — and afterwards both servers are healthy and still answer a valid request.

``$SPECDRAFT_FUZZ_EXAMPLES`` examples per RPC and kind (default 40 here; ``make fuzz`` runs
1 500: about 21 000 requests over the 8 RPCs, as hypothesis stops early where a message has no
fields to vary). The tally is printed at the end of the session.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datastore_svc.server import ShardServerConfig
from datastore_svc.shard import ShardState
from datastore_svc.store import write_version
from helpers.datastores import tiny_identity
from helpers.servers import ADMIN, ADMIN_TOKEN, ServerThread, ShardThread, tiny_worker
from llm_worker.server import ServerConfig
from specdraft.security import ServerSecurity
from specdraft.stubs import datastore_pb2, generation_pb2

EXAMPLES = int(os.environ.get("SPECDRAFT_FUZZ_EXAMPLES", "40"))
VOCAB = 96
TALLY: Counter[tuple[str, str]] = Counter()  # (method, status) over the session

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
DATASTORE = datastore_pb2.DESCRIPTOR.services_by_name["Datastore"]
ADMIN_SERVICE = datastore_pb2.DESCRIPTOR.services_by_name["DatastoreAdmin"]


def _request_class(method: Any) -> type[Message]:
    module = generation_pb2 if method.containing_service is GENERATION else datastore_pb2
    return getattr(module, method.input_type.name)  # type: ignore[no-any-return]


METHODS = [
    (service, method, _request_class(method))
    for service in (GENERATION, DATASTORE, ADMIN_SERVICE)
    for method in service.methods
]

# -- values at the edges of each field type ----------------------------------------------------------

_INT32 = st.one_of(
    st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), VOCAB, VOCAB - 1]), st.integers(-(2**31), 2**31 - 1)
)
_UINT32 = st.one_of(st.sampled_from([0, 1, 2**32 - 1, 256, 1024, 100_000]), st.integers(0, 2**32 - 1))
_INT64 = st.one_of(st.sampled_from([0, -1, 2**63 - 1]), st.integers(-(2**63), 2**63 - 1))
_UINT64 = st.one_of(st.sampled_from([0, 2**64 - 1]), st.integers(0, 2**64 - 1))
_FLOAT = st.one_of(
    st.sampled_from([0.0, -1.0, 1.0, 1e30, float("nan"), float("inf"), -float("inf")]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
_TEXT = st.one_of(
    st.sampled_from(
        ["", "ar", "pld", "rest:n=100000:l=256", "pld+a:file=/dev/zero", "../..", "v1", "😀", "\x00"]
    ),
    st.text(max_size=40),
)

_SCALARS = {
    FieldDescriptor.TYPE_INT32: _INT32,
    FieldDescriptor.TYPE_SINT32: _INT32,
    FieldDescriptor.TYPE_UINT32: _UINT32,
    FieldDescriptor.TYPE_INT64: _INT64,
    FieldDescriptor.TYPE_UINT64: _UINT64,
    FieldDescriptor.TYPE_FLOAT: _FLOAT,
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: _TEXT,
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=40),
}


@st.composite
def messages(draw: st.DrawFn, cls: type[Message], depth: int = 0) -> Message:
    """A message of ``cls`` with a random subset of its fields set (one member per oneof)."""
    msg = cls()
    descriptor: Descriptor = cls.DESCRIPTOR
    chosen_oneofs = {
        o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in descriptor.oneofs
    }
    for field in descriptor.fields:
        if field.containing_oneof is not None and chosen_oneofs[field.containing_oneof.name] != field.name:
            continue
        if field.containing_oneof is None and not draw(st.booleans()):
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth > 3:
                continue
            sub = GetMessageClass(field.message_type)
            if field.is_repeated:
                for item in draw(st.lists(messages(sub, depth + 1), max_size=3)):
                    getattr(msg, field.name).add().CopyFrom(item)
            else:
                getattr(msg, field.name).CopyFrom(draw(messages(sub, depth + 1)))
            continue
        values = _SCALARS[field.type] if field.type != FieldDescriptor.TYPE_ENUM else st.integers(-3, 10)
        if field.is_repeated:
            getattr(msg, field.name).extend(draw(st.lists(values, max_size=50)))
        else:
            setattr(msg, field.name, draw(values))
    return msg


@st.composite
def mutated(draw: st.DrawFn, cls: type[Message]) -> bytes:
    """A valid message's bytes, damaged: bytes flipped, the end cut, garbage appended."""
    data = bytearray(draw(messages(cls)).SerializeToString())
    for _ in range(draw(st.integers(0, 4))):
        if data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    if data and draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    data += draw(st.binary(max_size=8))
    return bytes(data)


# -- the servers -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fuzz-versions")
    rng = np.random.default_rng(0)
    for name in ("v1", "v2"):
        docs = [rng.integers(0, 6, size=50).astype(np.int32) for _ in range(20)]
        write_version(docs, root / name, VOCAB, tiny_identity(VOCAB), shards=1)
    shard = ShardThread(
        ShardState.open(root / "v1", 0),
        ShardServerConfig(port=0, admin_port=0, security=ServerSecurity(admin_tokens=(ADMIN_TOKEN,))),
    )
    worker = ServerThread(
        tiny_worker(tiny_dir, "w-fuzz"), ServerConfig(port=0, max_concurrent=2, max_generation_seconds=1.0)
    )
    try:
        yield {
            GENERATION.full_name: worker.address,
            DATASTORE.full_name: shard.address,
            ADMIN_SERVICE.full_name: shard.admin_address,
        }
    finally:
        worker.stop()
        shard.stop()
        summary = ", ".join(f"{m} {s}: {n}" for (m, s), n in sorted(TALLY.items()))
        print(f"\nfuzz: {sum(TALLY.values())} requests ({summary})")


def call(address: str, path: str, payload: bytes, streaming: bool, admin: bool) -> grpc.StatusCode:
    channel = ADMIN.channel(address) if admin else grpc.insecure_channel(address)
    with channel:
        try:
            if streaming:
                for _ in channel.unary_stream(path)(payload, timeout=5):
                    pass
            else:
                channel.unary_unary(path)(payload, timeout=5)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def check_one(servers: dict[str, Any], service: Any, method: Any, payload: bytes, admin: bool = True) -> None:
    path = f"/{service.full_name}/{method.name}"
    code = call(servers[service.full_name], path, payload, method.server_streaming, admin)
    TALLY[(method.name, code.name)] += 1
    assert code != grpc.StatusCode.UNKNOWN, f"{path} answered UNKNOWN to {payload!r}"
    assert code != grpc.StatusCode.UNAVAILABLE, f"{path}: the server went away after {payload!r}"


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
    database=None,
)


@pytest.mark.parametrize("service,method,cls", METHODS, ids=[f"{s.name}.{m.name}" for s, m, _ in METHODS])
def test_generated_messages(servers: dict[str, Any], service: Any, method: Any, cls: type[Message]) -> None:
    @FUZZ
    @given(msg=messages(cls), admin=st.booleans())
    def run(msg: Message, admin: bool) -> None:
        check_one(servers, service, method, msg.SerializeToString(), admin)

    run()


@pytest.mark.parametrize("service,method,cls", METHODS, ids=[f"{s.name}.{m.name}" for s, m, _ in METHODS])
def test_mutated_messages(servers: dict[str, Any], service: Any, method: Any, cls: type[Message]) -> None:
    @FUZZ
    @given(payload=mutated(cls))
    def run(payload: bytes) -> None:
        check_one(servers, service, method, payload)

    run()


def test_both_servers_are_healthy_after_the_fuzzing(servers: dict[str, Any]) -> None:
    for address in (servers[GENERATION.full_name], servers[DATASTORE.full_name]):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    ok = generation_pb2.GenerateRequest(text="hello", max_new_tokens=4)
    path = f"/{GENERATION.full_name}/Generate"
    assert (
        call(servers[GENERATION.full_name], path, ok.SerializeToString(), False, False) == grpc.StatusCode.OK
    )
    retrieve = datastore_pb2.RetrieveRequest(sparse=datastore_pb2.SparseQuery(context=[1, 2]))
    path = f"/{DATASTORE.full_name}/Retrieve"
    assert (
        call(servers[DATASTORE.full_name], path, retrieve.SerializeToString(), False, False)
        == grpc.StatusCode.OK
    )
