# syntax=docker/dockerfile:1
# A datastore shard (and the image of the rebuild job), GPU build: CUDA torch and the [gpu] extra
# (faiss-gpu). From the repository root:
#   docker build -f deploy/container/datastore.gpu.Dockerfile -t specdraft-datastore:gpu .
# See worker.gpu.Dockerfile for the CUDA notes (TORCH_INDEX_URL, driver from the node).
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
RUN sh deploy/container/install.sh app gpu

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 specdraft \
 && useradd --uid 10001 --gid 10001 --home-dir /home/specdraft --create-home \
            --shell /usr/sbin/nologin specdraft \
 && install -d -o 10001 -g 10001 /cache /data
COPY --from=build /opt/venv /opt/venv
# The target's own committed corpus (corpus/<model>/): what the rebuild job builds from with
# k8s/components/own-corpus (CORPUS=/opt/specdraft/corpus/<model>).
COPY --from=build /src/corpus /opt/specdraft/corpus
ENV PATH=/opt/venv/bin:$PATH \
    SPECDRAFT_CACHE=/cache \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/specdraft
# gRPC (specdraft.v1.Datastore, grpc.health.v1, reflection) and Prometheus /metrics
# 50062: DatastoreAdmin (admin token); 50070: plaintext health alone, for probes. TLS from
# /etc/specdraft/tls, the admin token from /etc/specdraft/tokens (mount Secrets there; README, Security)
EXPOSE 50061 50062 50070 9100
ENTRYPOINT ["specdraft"]
CMD ["serve", "datastore", "--datastore", "/data/current", "--shard", "0", "--host", "0.0.0.0", \
     "--port", "50061", "--metrics-port", "9100", "--admin-port", "50062", "--health-port", "50070", \
     "--versions-root", "/data/versions", "--tls-cert", "/etc/specdraft/tls/tls.crt", "--tls-key", "/etc/specdraft/tls/tls.key", \
     "--tls-ca", "/etc/specdraft/tls/ca.crt", "--admin-token-file", "/etc/specdraft/tokens/admin-token"]
