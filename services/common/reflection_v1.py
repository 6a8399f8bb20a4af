"""gRPC server reflection v1 beside v1alpha.

grpcio-reflection ships only `grpc.reflection.v1alpha`; v1 (what grpcurl and newer tools ask
for first) has the same messages under another package, so the same wire bytes serve both.
We register the v1 descriptor (v1alpha's, renamed) in the default pool, so that v1 can be
described too, and route `/grpc.reflection.v1.ServerReflection/ServerReflectionInfo` to the
v1alpha servicer with v1alpha's (byte-identical) message types.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection v1alpha and v1 for `service_names` (both reflection services added)."""
    _register_v1_descriptor()
    names = [*service_names, reflection.SERVICE_NAME, SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)})
    server.add_generic_rpc_handlers((handler,))


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return  # registered already (by us, or by a grpcio-reflection that ships v1)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")

    def rename(type_name: str) -> str:
        return type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = rename(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = rename(method.input_type), rename(method.output_type)
    pool.AddSerializedFile(proto.SerializeToString())
