# syntax=docker/dockerfile:1
# The LLM worker, GPU build. From the repository root:
#   docker build -f deploy/container/worker.gpu.Dockerfile -t specdraft-worker:gpu .
# Same base as the CPU image: the CUDA build of torch brings its CUDA runtime as nvidia-* wheels
# and the NVIDIA driver is mounted from the node by the container toolkit / device plugin.
# Choose the CUDA build that the nodes' driver supports with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY constraints.txt deploy/container/install.sh ./
RUN TORCH_INDEX_URL="$TORCH_INDEX_URL" sh install.sh torch gpu
COPY . .
RUN sh deploy/container/install.sh app gpu \
 && sh deploy/container/install.sh model /opt/specdraft/models/SmolLM2-135M-Instruct

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 specdraft \
 && useradd --uid 10001 --gid 10001 --home-dir /home/specdraft --create-home \
            --shell /usr/sbin/nologin specdraft \
 && install -d -o 10001 -g 10001 /cache
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/specdraft /opt/specdraft
ENV PATH=/opt/venv/bin:$PATH \
    SPECDRAFT_CACHE=/cache \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/specdraft
# gRPC (specdraft.v1.Generation, grpc.health.v1, reflection) and Prometheus /metrics
# TLS from /etc/specdraft/tls and client tokens from /etc/specdraft/tokens (mount Secrets there;
# README, Security); 50060: plaintext health alone, for probes
EXPOSE 50051 50060 9100
ENTRYPOINT ["specdraft"]
CMD ["serve", "worker", "--model", "/opt/specdraft/models/SmolLM2-135M-Instruct", "--device", "cuda", \
     "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100", "--health-port", "50060", \
     "--tls-cert", "/etc/specdraft/tls/tls.crt", "--tls-key", "/etc/specdraft/tls/tls.key", \
     "--token-file", "/etc/specdraft/tokens/client-tokens"]
