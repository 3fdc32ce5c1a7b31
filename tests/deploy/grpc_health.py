"""A grpc.health.v1 client that is not the project's: Debian's python3-grpcio
and python3-protobuf, with the two messages of
https://github.com/grpc/grpc/blob/master/src/proto/grpc/health/v1/health.proto
declared here as a descriptor (Debian ships no compiled health stubs).

Usage as a program: grpc_health.py HOST:PORT [SERVICE] prints the status
(SERVING, NOT_SERVING, SERVICE_UNKNOWN, UNKNOWN) or the gRPC error code.
"""
import sys

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory


def _messages():
    f = descriptor_pb2.FileDescriptorProto()
    f.name = "localsgd_test/grpc_health_v1.proto"
    f.package = "grpc.health.v1"
    f.syntax = "proto3"
    req = f.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1,
                  type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    resp = f.message_type.add(name="HealthCheckResponse")
    enum = resp.enum_type.add(name="ServingStatus")
    for number, name in enumerate(
            ["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"]):
        enum.value.add(name=name, number=number)
    resp.field.add(name="status", number=1,
                   type=descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
                   type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
                   label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    get = (message_factory.GetMessageClass
           if hasattr(message_factory, "GetMessageClass")
           else message_factory.MessageFactory(pool).GetPrototype)
    return (get(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
            get(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")))


HealthCheckRequest, HealthCheckResponse = _messages()
_STATUS = HealthCheckResponse.DESCRIPTOR.enum_types_by_name["ServingStatus"]


def check(target, service="", timeout=5.0, root_cert=None):
    """Returns the status name, or the gRPC code name if the call failed.
    With `root_cert` (PEM bytes), over TLS verified against it."""
    channel = grpc.secure_channel(
        target, grpc.ssl_channel_credentials(root_certificates=root_cert)) \
        if root_cert else grpc.insecure_channel(target)
    with channel:
        call = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString)
        try:
            response = call(HealthCheckRequest(service=service),
                            timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return _STATUS.values_by_number[response.status].name


if __name__ == "__main__":
    print(check(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""))
