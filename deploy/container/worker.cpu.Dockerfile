# syntax=docker/dockerfile:1
# The LLM worker, CPU build. From the repository root:
#   docker build -f deploy/container/worker.cpu.Dockerfile -t specdraft-worker:cpu .
# The four images (worker|datastore x cpu|gpu) share deploy/container/install.sh and differ
# only in the torch build, the [gpu] extra and what the last stage exposes and runs.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv \
 && apt-get update && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY constraints.txt deploy/container/install.sh ./
RUN sh install.sh torch cpu
COPY . .
RUN sh deploy/container/install.sh app cpu \
 && sh deploy/container/install.sh model /opt/specdraft/models/SmolLM2-135M-Instruct \
 && sh deploy/container/install.sh native /opt/specdraft/native

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 specdraft \
 && useradd --uid 10001 --gid 10001 --home-dir /home/specdraft --create-home \
            --shell /usr/sbin/nologin specdraft \
 && install -d -o 10001 -g 10001 /cache
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/specdraft /opt/specdraft
# SPECDRAFT_CACHE holds the measured cost curves (and converted models other than the baked
# one): Kubernetes mounts an emptyDir there, the root filesystem stays read-only. The fused CPU
# kernels were compiled in the build stage (x86-64 with AVX2; elsewhere torch operations run).
ENV PATH=/opt/venv/bin:$PATH \
    SPECDRAFT_CACHE=/cache \
    SPECDRAFT_NATIVE_DIR=/opt/specdraft/native \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/specdraft
# gRPC (specdraft.v1.Generation, grpc.health.v1, reflection) and Prometheus /metrics
# TLS from /etc/specdraft/tls and client tokens from /etc/specdraft/tokens (mount Secrets there;
# README, Security); 50060: plaintext health alone, for probes
EXPOSE 50051 50060 9100
ENTRYPOINT ["specdraft"]
CMD ["serve", "worker", "--model", "/opt/specdraft/models/SmolLM2-135M-Instruct", \
     "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100", "--health-port", "50060", \
     "--tls-cert", "/etc/specdraft/tls/tls.crt", "--tls-key", "/etc/specdraft/tls/tls.key", \
     "--token-file", "/etc/specdraft/tokens/client-tokens"]
