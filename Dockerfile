# syntax=docker/dockerfile:1
#
# trainserve: one image for every stage (train, consolidate, export, run) and for the server.
#
#   docker build -t trainserve .
#   docker run --gpus all --shm-size 16g -v "$PWD:/work" trainserve \
#       pipeline train --config configs/fashion_mnist_resnet18.yaml --nproc-per-node 8
#   docker run --gpus all -p 8080:8080 -e MLFLOW_TRACKING_URI=http://tracking:5000 \
#       -e TRAINSERVE_MODEL=models:/resnet18-fashion-mnist@champion trainserve      # the server
#
# Versions, and why they fit together (see docs/docker.md):
#   - onnxruntime-gpu 1.31.1 on PyPI is built for CUDA 13.0 and cuDNN 9 (its build info says
#     cuda_version 13.0; its extras ask for nvidia-cuda-runtime~=13.0, nvidia-cudnn-cu13~=9.0).
#   - torch 2.13.0 publishes CUDA 12.6 and 13.0 builds (13.2 experimental); cu130 ships cuDNN 9.20.
#   - So: CUDA 13.0 + cuDNN 9 everywhere. The server never imports torch; it calls
#     onnxruntime.preload_dlls() before a CUDA session (nvidia-* wheels first, then the system loader
#     path, where the base image's CUDA 13 and cuDNN 9 are), and `--device cuda` refuses to start if
#     the CUDA provider did not load. torch loads the nvidia-* wheels it depends on.
#   - CUDA 13 runs on Turing (sm 7.5) and newer with a driver >= 580. For Volta or older GPUs, build
#     with TORCH_CUDA=cu126 and a 12.x base, and an onnxruntime-gpu built for CUDA 12.

ARG CUDA_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.8

FROM ${UV_IMAGE} AS uv

FROM ${CUDA_IMAGE}

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu130
ARG ONNXRUNTIME_VERSION=1.31.1
ARG UID=1000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# tini as PID 1: forwards SIGTERM to the server's graceful shutdown and to torchrun, and reaps the
# worker processes torchrun and DataLoader leave behind. Unpinned apt packages: the base image tag
# pins the distribution release, and security updates should land on rebuild.
# And libgrpc++-dev, pkg-config and g++: setup.py builds the native gRPC front end (serving/grpc/native.cc, grpc's C++
# server) against the distribution's grpc; the -dev package keeps the runtime library it depends on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates tini libgrpc++-dev pkg-config g++ \
    && rm -rf /var/lib/apt/lists/*

# A non-root user whose UID (default 1000, the usual first user on a host) owns /work, so runs
# written to a bind-mounted directory belong to you. Ubuntu 24.04 images ship a user 'ubuntu' with
# UID 1000: it goes first.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid "${UID}" trainserve \
    && useradd --create-home --uid "${UID}" --gid "${UID}" --shell /bin/bash trainserve \
    && mkdir -p /work/outputs /work/data \
    && chown -R trainserve:trainserve /work

# Python 3.11 from uv (a standalone CPython build; Ubuntu 24.04 ships only 3.12) in a venv under
# /opt, owned by root: the application is read-only to the user that runs it. Bytecode is compiled
# at install time because that user can't write __pycache__ there. No package cache in any layer.
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    UV_NO_CACHE=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}
RUN uv python install "${PYTHON_VERSION}" \
    && uv venv --python "${PYTHON_VERSION}" /opt/venv

# The heavy layer first, so that changing the project never downloads it again: the CUDA build of
# torch from the PyTorch index for this CUDA major, then onnxruntime-gpu from PyPI. The PyTorch
# index is an *extra* index because uv gives extra indexes priority: torch and its nvidia-* wheels
# come from it, what it lacks from PyPI. The constraints file keeps every later install (the
# project's `torch>=2.6`, images built FROM this one) from swapping these builds out.
# (`torch==2.13.0` matches the installed 2.13.0+cu130: a public version ignores the local label.)
RUN printf 'torch==%s\nonnxruntime-gpu==%s\n' "${TORCH_VERSION}" "${ONNXRUNTIME_VERSION}" > /opt/constraints.txt \
    && uv pip install --extra-index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
        "torch==${TORCH_VERSION}+${TORCH_CUDA}" \
    && uv pip install --constraint /opt/constraints.txt "onnxruntime-gpu==${ONNXRUNTIME_VERSION}"
ENV UV_CONSTRAINT=/opt/constraints.txt

# The project's dependencies, read from pyproject.toml alone: this layer is rebuilt only when the
# dependency list changes, not when the code does. (README.md* because pyproject names it as the
# long description; the wildcard lets a checkout without it still build.)
WORKDIR /opt/trainserve
COPY pyproject.toml README.md* ./
# --extra gpu: nvidia-ml-py, through which MLflow samples the GPUs for its system metrics.
RUN uv pip install --requirement pyproject.toml --extra gpu

# The code, then the project itself without dependencies (all present above). The build fails here,
# not on a GPU node, if the wheels don't fit: broken requirements, a torch built for another CUDA
# than TORCH_CUDA (or none), or an onnxruntime whose CUDA provider could not load here. That is
# checked on the libraries, not with get_available_providers() (which lists CUDA for any
# onnxruntime-gpu wheel, whatever is installed): `ldd` on the provider library must find every
# library it links (libcuda.so.1 excepted: the driver's, mounted when a GPU container starts) and
# ldconfig's cache must hold cuDNN 9, which the provider dlopen()s (serving.engine.system_cuda_libraries_missing).
COPY pipeline/ pipeline/
COPY serving/ serving/
COPY setup.py ./
COPY configs/ configs/
RUN uv pip install --no-deps . \
    && uv pip check \
    && python -P -c "from serving.grpc import native; assert native.available(), native.WHY_NOT" \
    && TORCH_CUDA="${TORCH_CUDA}" python -c "import os, torch; \
assert 'cu' + (torch.version.cuda or 'none').replace('.', '') == os.environ['TORCH_CUDA'], torch.version.cuda" \
    && python -c "import sys; from serving.engine import system_cuda_libraries_missing; \
missing = system_cuda_libraries_missing(); \
sys.exit(f'onnxruntime CUDA provider: libraries not found: {missing}' if missing else 0)" \
    && rm -rf build ./*.egg-info \
    && ln -s /opt/trainserve/configs /work/configs

# Runs happen in /work: the embedded MLflow store (mlflow.db, mlartifacts/), outputs/ (checkpoints,
# consolidated weights, ONNX), data/. Mount a host directory or volumes there; /work/configs points
# at the configs baked into the image (a bind mount of the whole /work brings your own instead).
WORKDIR /work
# Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER ${UID}:${UID}

# The server reads TRAINSERVE_* (every flag of `python -m serving` has one). Its default bind address
# is 127.0.0.1, which inside a container is unreachable from outside it, even with -p: bind every
# interface here and let `docker run -p` / compose decide what is published. Bound so, the server
# refuses to start without TRAINSERVE_AUTH_TOKEN (or TRAINSERVE_ALLOW_UNAUTHENTICATED=1 behind a proxy
# that authenticates).
# MLFLOW_TRACKING_URI is left unset: the embedded SQLite store in /work unless you point at a server.
# PYTHONSAFEPATH: `python -m serving` does not put the working directory first on sys.path, so a checkout mounted
# at /work cannot stand in for the installed package (whose native gRPC front end a checkout lacks).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONSAFEPATH=1 \
    MPLBACKEND=Agg \
    TRAINSERVE_HOST=0.0.0.0 \
    TRAINSERVE_PORT=8080

EXPOSE 8080

# Ready = the model is loaded and warmed up. Health endpoints skip the bearer token, so this works
# with TRAINSERVE_AUTH_TOKEN set. No curl in the image: Python's urllib raises on anything but 2xx.
# Training containers have no server: compose overrides this check for them.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('TRAINSERVE_PORT', '8080') + '/v2/health/ready', timeout=4)"]

# Any command runs as given (`docker run IMAGE pipeline train ...`, `... pipeline ui --host 0.0.0.0`,
# `... torchrun ...`); with none, the image serves TRAINSERVE_MODEL.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["python", "-m", "serving"]
