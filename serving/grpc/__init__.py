"""KServe V2 (Open Inference Protocol) over gRPC.

schema.py   the protocol's messages, built at import into a private descriptor pool
codec.py    ModelInferRequest -> validated arrays, arrays -> ModelInferResponse; pure
service.py  the grpc.aio GRPCInferenceService over the HTTP server's models
"""
