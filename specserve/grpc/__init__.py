"""specserve's gRPC API: specserve.proto and its generated code (specserve_pb2, specserve_pb2_grpc),
which Ray Serve's gRPC proxy imports (`grpc_servicer_functions`: SERVICER_FUNCTION)."""

SERVICER_FUNCTION = "specserve.grpc.specserve_pb2_grpc.add_SpecserveServicer_to_server"
SERVICE_NAME = "specserve.v1.Specserve"
DEFAULT_PORT = 9000


def grpc_options(port: int = DEFAULT_PORT) -> dict:
    """Serve's `grpc_options` that serve this API (the same block every manifest carries)."""
    return {"port": port, "grpc_servicer_functions": [SERVICER_FUNCTION], "enable_reflection": True}
