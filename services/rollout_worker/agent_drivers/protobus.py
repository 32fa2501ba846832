"""A gRPC client for a server whose API ships as a protobuf descriptor set (Cline's ProtoBus).

Invariants:
- No generated code and no protoc: message classes and method stubs are built at run time from
  the descriptor set, so a newer server version needs no rebuild of ours.
- Every unary call has a deadline; a stream is returned as the gRPC call object, so the caller
  can ``cancel()`` it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory


class ProtoBus:
    def __init__(self, address: str, descriptor_set: Path):
        files = descriptor_pb2.FileDescriptorSet()
        files.ParseFromString(Path(descriptor_set).read_bytes())
        self.pool = descriptor_pool.DescriptorPool()
        for file in files.file:
            self.pool.Add(file)
        self.channel = grpc.insecure_channel(address)

    def wait_ready(self, timeout_s: float) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def message(self, full_name: str, **fields: Any) -> Any:
        return message_factory.GetMessageClass(self.pool.FindMessageTypeByName(full_name))(**fields)

    def enum_value(self, enum: str, name: str) -> int:
        return self.pool.FindEnumTypeByName(enum).values_by_name[name].number

    def enum_name(self, enum: str, number: int) -> str:
        value = self.pool.FindEnumTypeByName(enum).values_by_number.get(number)
        return value.name if value is not None else str(number)

    def call(self, service: str, method: str, timeout_s: float = 30.0, **fields: Any) -> Any:
        stub, request = self._stub(service, method, fields)
        return stub(request, timeout=timeout_s)

    def stream(self, service: str, method: str, **fields: Any) -> Any:
        stub, request = self._stub(service, method, fields)
        return stub(request)

    def close(self) -> None:
        self.channel.close()

    def _stub(self, service: str, method: str, fields: dict[str, Any]) -> tuple[Any, Any]:
        descriptor = self.pool.FindServiceByName(service).FindMethodByName(method)
        reply = message_factory.GetMessageClass(descriptor.output_type)
        make = self.channel.unary_stream if descriptor.server_streaming else self.channel.unary_unary
        stub = make(f"/{service}/{method}", request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=reply.FromString)
        return stub, self.message(descriptor.input_type.full_name, **fields)
