"""Shared fixtures: the real default model, a tiny random model, and transformers' own generate."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from baton.engine.model import LoadedModel, load_model


class Reference:
    """`transformers` generate on a separate copy of the same weights: the ground truth."""

    def __init__(self, name: str):
        self.loaded = load_model(name)
        self.loaded.model.set_attn_implementation("sdpa")

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        model = self.loaded.model
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.generation_config.pad_token_id)
        return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    return load_model("default")


@pytest.fixture(scope="session")
def default_reference() -> Reference:
    return Reference("default")


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="session")
def tiny_reference() -> Reference:
    return Reference("tiny-random")


@pytest.fixture
def grpc_server():
    """start(add, servicer, options) -> the loopback address of a gRPC server serving the test's
    servicer (`add` is the generated add_..._to_server); every one is stopped after the test."""
    servers = []

    def start(add, servicer, options=()) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=list(options))
        add(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)
