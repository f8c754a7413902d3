"""The asyncio client: `AsyncBatonClient`, the same surface as BatonClient on grpc.aio.

    async with AsyncBatonClient("localhost:50051") as client:
        result = await client.generate("What is the capital of France?", max_tokens=32)
        async for chunk in client.stream("Write a haiku.", temperature=0.7, seed=1):
            print(chunk.text_delta, end="", flush=True)

Make the client inside the event loop that uses it (grpc.aio channels belong to one loop).
"""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import grpc.aio

from baton.v1 import router_pb2, router_pb2_grpc
from baton.client.channel import (DEFAULT_KEEPALIVE_S, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_RETRIES,
                                  DEFAULT_READY_TIMEOUT_S, DEFAULT_TIMEOUT_S, READY_POLL_S, ConnectionConfig,
                                  PemSource)
from baton.client.convert import (ResultAssembler, build_request, chunk_from_proto, cluster_status_from_proto,
                            model_info_from_proto)
from baton.client.errors import BatonError, DeadlineExceeded, Unavailable, error_from_rpc
from baton.client.many import BatchCollector, batch_request, finish_batch, prepare_batch
from baton.client.types import BatchOutcome, ClusterStatus, GenerationResult, ModelInfo, StreamChunk


class AsyncChunkStream:
    """The chunks of one streaming request, as an async iterator.

    Closing it cancels the RPC: `await stream.aclose()` (or cancel()), leave an `async with`
    block, or break out of `async for chunk in client.stream(...)` (the unreferenced stream is
    cancelled when dropped). `await stream.result()` reads what is left and returns the whole."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, request_id: str | None):
        self._call = call
        self._assembler = ResultAssembler(request_id)
        self._done = False

    def __aiter__(self) -> "AsyncChunkStream":
        return self

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        try:
            response = await self._call.read()
        except grpc.RpcError as error:
            self._done = True
            raise error_from_rpc(error, self._assembler.request_id) from error
        if response is grpc.aio.EOF:
            self._done = True
            self._assembler.check_finished()
            raise StopAsyncIteration
        chunk = chunk_from_proto(response)
        self._assembler.add(chunk)
        return chunk

    @property
    def request_id(self) -> str | None:
        return self._assembler.request_id

    async def result(self) -> GenerationResult:
        async for _ in self:
            pass
        return self._assembler.result()

    def cancel(self) -> None:
        """Cancel the RPC if it is still running; a finished stream is left as it is."""
        if not self._done:
            self._done = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> "AsyncChunkStream":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.cancel()

    def __del__(self) -> None:
        if hasattr(self, "_call"):  # __init__ may not have run to the end
            try:
                self.cancel()
            except Exception:  # the event loop may already be closed; nothing is left to free then
                pass


class AsyncBatonClient:
    """A grpc.aio connection to a Baton router; arguments as BatonClient's."""

    def __init__(self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S, tls: bool = False,
                 root_certificates: PemSource = None, client_cert: PemSource = None,
                 client_key: PemSource = None, token: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls_server_name: str | None = None,
                 keepalive_s: float | None = DEFAULT_KEEPALIVE_S, load_balancing: str | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES):
        self._config = ConnectionConfig.from_args(
            target, timeout=timeout, tls=tls, root_certificates=root_certificates, client_cert=client_cert,
            client_key=client_key, token=token, max_message_bytes=max_message_bytes,
            tls_server_name=tls_server_name, keepalive_s=keepalive_s, load_balancing=load_balancing,
            max_retries=max_retries)
        credentials = self._config.credentials()
        options = self._config.options()
        self._channel = (grpc.aio.secure_channel(self._config.target, credentials, options=options) if credentials
                         else grpc.aio.insecure_channel(self._config.target, options=options))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    @property
    def target(self) -> str:
        return self._config.target

    async def generate(self, prompt: str | None = None, *, messages: Sequence[Any] | None = None,
                       token_ids: Sequence[int] | None = None, raw: bool = False, request_id: str | None = None,
                       timeout: float | None = None, **sampling: Any) -> GenerationResult:
        """Run one request to the end and return it whole; arguments as BatonClient.generate."""
        async with self.stream(prompt, messages=messages, token_ids=token_ids, raw=raw, request_id=request_id,
                               timeout=timeout, **sampling) as chunks:
            return await chunks.result()

    def stream(self, prompt: str | None = None, *, messages: Sequence[Any] | None = None,
               token_ids: Sequence[int] | None = None, raw: bool = False, request_id: str | None = None,
               timeout: float | None = None, **sampling: Any) -> AsyncChunkStream:
        """Start one request; `async for` its chunks. Arguments are checked here, at once."""
        request = build_request(prompt, messages=messages, token_ids=token_ids, raw=raw,
                                request_id=request_id, **sampling)
        call = self._stub.Generate(request, timeout=self._config.deadline(timeout),
                                   metadata=self._config.metadata())
        return AsyncChunkStream(call, request.request_id)

    async def generate_many(self, requests: Sequence[str | Mapping[str, Any]], *, max_concurrency: int = 16,
                            timeout: float | None = None, return_exceptions: bool = False,
                            **defaults: Any) -> list[GenerationResult | BatonError]:
        """Many requests at once, at most max_concurrency in flight; the same rules as
        BatonClient.generate_many (input order, all run to the end, first failure raised)."""
        calls = prepare_batch(requests, max_concurrency, timeout, defaults)
        limit = asyncio.Semaphore(max_concurrency)

        async def run_one(kwargs: dict[str, Any]) -> GenerationResult | BatonError:
            async with limit:
                try:
                    return await self.generate(**kwargs)
                except BatonError as error:
                    return error

        outcomes = await asyncio.gather(*(run_one(kwargs) for kwargs in calls))
        return finish_batch(list(outcomes), return_exceptions)

    async def generate_batch(self, requests: Sequence[str | Mapping[str, Any]], *, max_concurrency: int = 0,
                             timeout: float | None = None, on_result=None, **defaults: Any) -> BatchOutcome:
        """A large offline batch through Router.GenerateBatch, planned by the router (BatchLLM);
        arguments and result as BatonClient.generate_batch. on_result(index, result_or_error) may
        be a plain function or a coroutine function (awaited before the next result is read)."""
        request = batch_request(requests, max_concurrency, defaults)
        if not request.requests:
            return BatchOutcome([], {})
        call = self._stub.GenerateBatch(request, timeout=self._config.deadline(timeout), metadata=self._config.metadata())
        collected = BatchCollector(len(request.requests), on_result)
        try:
            async for item in call:
                pending = collected.add(item)
                if inspect.isawaitable(pending):
                    await pending
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        finally:
            call.cancel()  # a no-op once the stream ended; frees the batch on the router otherwise
        return collected.outcome()

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return model_info_from_proto(
            await self._unary(self._stub.GetModelInfo, router_pb2.ModelInfoRequest(), timeout))

    async def cluster_status(self, *, timeout: float | None = None) -> ClusterStatus:
        return cluster_status_from_proto(
            await self._unary(self._stub.GetClusterStatus, router_pb2.ClusterStatusRequest(), timeout))

    async def wait_ready(self, timeout: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Wait until the router can serve a request, as BatonClient.wait_ready."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise Unavailable("UNAVAILABLE", f"no connection to the router at {self.target} "
                              f"within {timeout} s; is it running and is tls= right?") from None
        while True:
            try:
                status = await self.cluster_status(timeout=max(READY_POLL_S, deadline - loop.time()))
                missing = status.waiting_for()
            except (Unavailable, DeadlineExceeded) as exc:  # the router's own model is still loading
                missing = exc.message
            if missing is None:
                return
            if loop.time() >= deadline:
                raise Unavailable("UNAVAILABLE", f"the router at {self.target} could not serve within {timeout} s: "
                                  f"{missing}")
            await asyncio.sleep(READY_POLL_S)

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=self._config.deadline(timeout), metadata=self._config.metadata())
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    async def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> "AsyncBatonClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()
