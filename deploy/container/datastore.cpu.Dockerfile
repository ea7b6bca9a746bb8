# syntax=docker/dockerfile:1
# A datastore shard (and the image of the rebuild job: `specdraft datastore build|swap`), CPU build.
# From the repository root:
#   docker build -f deploy/container/datastore.cpu.Dockerfile -t specdraft-datastore:cpu .
# Same build as worker.cpu.Dockerfile without the baked model: shards do not run the model, and
# the rebuild job converts it into its own cache when a dense index needs hidden states.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv \
 && apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY constraints.txt deploy/container/install.sh ./
RUN sh install.sh torch cpu
COPY . .
RUN sh deploy/container/install.sh app cpu \
 && sh deploy/container/install.sh retrieval /opt/specdraft/native

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 specdraft \
 && useradd --uid 10001 --gid 10001 --home-dir /home/specdraft --create-home \
            --shell /usr/sbin/nologin specdraft \
 && install -d -o 10001 -g 10001 /cache /data
COPY --from=build /opt/venv /opt/venv
# The compiled retrieval, built in the build stage (the image has no compiler).
COPY --from=build /opt/specdraft/native /opt/specdraft/native
# The target's own committed corpus (corpus/<model>/): what the rebuild job builds from with
# k8s/components/own-corpus (CORPUS=/opt/specdraft/corpus/<model>).
COPY --from=build /src/corpus /opt/specdraft/corpus
ENV PATH=/opt/venv/bin:$PATH \
    SPECDRAFT_CACHE=/cache \
    SPECDRAFT_NATIVE_DIR=/opt/specdraft/native \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/specdraft
# gRPC (specdraft.v1.Datastore, grpc.health.v1, reflection) and Prometheus /metrics
# 50062: DatastoreAdmin (admin token); 50070: plaintext health alone, for probes. TLS from
# /etc/specdraft/tls, the admin token from /etc/specdraft/tokens (mount Secrets there; README, Security)
EXPOSE 50061 50062 50070 9100
ENTRYPOINT ["specdraft"]
# /data/current: the link to the current version under /data/versions/ (see k8s/README.md)
CMD ["serve", "datastore", "--datastore", "/data/current", "--shard", "0", "--host", "0.0.0.0", \
     "--port", "50061", "--metrics-port", "9100", "--admin-port", "50062", "--health-port", "50070", \
     "--versions-root", "/data/versions", "--tls-cert", "/etc/specdraft/tls/tls.crt", "--tls-key", "/etc/specdraft/tls/tls.key", \
     "--tls-ca", "/etc/specdraft/tls/ca.crt", "--admin-token-file", "/etc/specdraft/tokens/admin-token"]
