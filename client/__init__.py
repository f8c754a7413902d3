"""Baton's gRPC client SDK (sync and asyncio). Light on purpose: grpc, protobuf and baton.v1 only.

    from baton.client import BatonClient
    with BatonClient("localhost:50051") as baton:
        print(baton.generate("What is the capital of France?", max_tokens=32).text)
"""
from baton.client.aio import AsyncBatonClient, AsyncChunkStream
from baton.client.errors import (BatonError, Cancelled, DeadlineExceeded, InvalidRequest, Overloaded, PermissionDenied,
                           Unauthenticated, Unavailable, error_from_rpc)
from baton.client.sync import BatonClient, ChunkStream
from baton.client.types import (ClusterStatus, GenerationResult, Guide, ModelInfo, SamplingOptions, Setting,
                                StreamChunk, TokenLogprob, Trace, Usage, WorkerStatus)

__all__ = [
    "AsyncBatonClient", "AsyncChunkStream", "BatonClient", "ChunkStream",
    "GenerationResult", "StreamChunk", "Usage", "Trace", "ModelInfo", "Setting", "ClusterStatus", "WorkerStatus",
    "SamplingOptions", "Guide", "TokenLogprob",
    "BatonError", "InvalidRequest", "Overloaded", "DeadlineExceeded", "Unavailable", "Cancelled",
    "Unauthenticated", "PermissionDenied", "error_from_rpc",
]
