"""Which executor runs a loaded model: Baton's own (the default where it applies) or the
`transformers` forward as the reference, for models the Baton executor does not cover."""
from __future__ import annotations

import logging

from baton.config import EXECUTOR_CHOICES
from baton.engine.llama import LlamaRunner, unsupported_reason
from baton.engine.model import LoadedModel, load_model
from baton.engine.runner import TransformersRunner

log = logging.getLogger(__name__)

EXECUTORS = EXECUTOR_CHOICES
Runner = LlamaRunner | TransformersRunner  # or, tensor-parallel, engine.tensor_parallel's


def make_runner(loaded: LoadedModel, executor: str = "auto", attention_backend: str = "auto",
                cuda_graphs: bool = True, batch_invariant: bool = True) -> Runner:
    """`auto`: the Baton executor where it can run the model, else the reference with one log line.
    cuda_graphs: on CUDA, the Baton executor's decode steps replay captured graphs.
    batch_invariant: on CUDA in bf16/fp16, the Baton executor's fixed-order kernels (`engine.llama`)."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    reason = unsupported_reason(loaded)
    if executor == "baton" and reason:
        raise ValueError(f"the Baton executor cannot run {loaded.name}: {reason}; use --executor transformers")
    if executor == "transformers" or reason:
        if loaded.model is None:
            raise ValueError(f"{loaded.name} was read without transformers' module (load_model(module=False)); "
                             "the transformers executor needs it")
        if reason:
            log.warning("the Baton executor cannot run %s (%s); serving it with the transformers executor",
                        loaded.name, reason)
        return TransformersRunner(loaded, attention_backend)
    return LlamaRunner(loaded, attention_backend, cuda_graphs, batch_invariant)


def load_runner(settings) -> Runner:
    """A worker's model and executor from its `model` settings (baton.config.ModelSettings): threads
    and cores first, so loading already runs on them."""
    from baton.engine import threads

    if settings.tensor_parallel_size > 1:  # one process per rank (this one is rank 0)
        from baton.engine import tensor_parallel

        return tensor_parallel.start(settings)
    threads.configure(settings.threads, settings.cpu_cores)
    # Baton's executor needs the weights alone: read straight from the files where it can run the
    # model; transformers' module where the reference executor may serve it
    loaded = load_model(settings.name, dtype=settings.dtype, device=settings.device, module=False,
                        quantization=settings.quantization, quantized_inputs=settings.quantized_inputs) \
        if settings.executor != "transformers" else None
    if loaded is None or (settings.executor == "auto" and unsupported_reason(loaded) is not None
                          and settings.quantization == "none"):
        loaded = load_model(settings.name, dtype=settings.dtype, device=settings.device)
    if loaded.tokenizer is not None:  # structured outputs' grammar tokenizer, off the serving path
        loaded.grammars.warm_up()
    runner = make_runner(loaded, settings.executor, settings.attention_backend, settings.cuda_graphs,
                         settings.batch_invariant)
    loaded.hand_over()
    return runner
