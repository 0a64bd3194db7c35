# mcp-tasks-proxy container image: `make docker`, or `docker build -t mcp-tasks-proxy .`
#
# Run it as a sidecar that shares the legacy MCP server's network namespace (a Kubernetes pod, see
# config/kubernetes/, or `docker run --network container:<legacy-server>`): the proxy listens on :8080 and
# reaches the unchanged legacy server at http://127.0.0.1:9000/mcp. Override any setting with
# MCP_TASKS_PROXY_<SECTION>__<FIELD> environment variables, or mount another file over
# /etc/mcp-tasks-proxy/proxy.yaml. Keep the task database on a volume at /var/lib/mcp-tasks-proxy.

# BASE: the Debian-based image with Python >= 3.11 both stages start from (the venv links to its interpreter,
# so the two must be the same). `make image-test` builds it locally with mmdebstrap (Debian bookworm plus
# python3, python3-venv and passwd) because no container registry is reachable there.
ARG BASE=python:3.12-slim

# --- build: a self-contained virtual environment with the proxy and its dependencies ---------------------
FROM ${BASE} AS build

# WHEELS: empty (the default) installs the proxy and its dependencies from the package index, over the
# build's network. A directory of the build context instead (e.g. WHEELS=wheels, filled on the build host
# with `pip wheel . --wheel-dir wheels`) installs only from the wheels there, with no network at all: this
# is how `make image-test` builds where the index is reached only through TLS the image does not trust.
# The wheels must suit BASE's Python; they are mounted for the one RUN, never copied into an image
# (RUN --mount: BuildKit, Docker's default builder since 23.0, or podman/buildah).
ARG WHEELS=

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

RUN python3 -m venv /opt/venv

WORKDIR /src
# Only what the wheel is built from: the package metadata, the readme and license it embeds, and the package itself.
COPY pyproject.toml README.md LICENSE ./
COPY proxy/ ./proxy/
RUN --mount=type=bind,target=/context \
    if [ -z "$WHEELS" ]; then /opt/venv/bin/pip install --no-cache-dir . ; \
    else /opt/venv/bin/pip install --no-cache-dir --no-index --find-links "/context/$WHEELS" mcp-tasks-proxy ; fi

# --- runtime: the venv on a clean base, run as an unprivileged user ---------------------------------------
FROM ${BASE}

LABEL org.opencontainers.image.title="mcp-tasks-proxy" \
      org.opencontainers.image.description="Sidecar reverse proxy that serves a legacy MCP server as an MCP 2026-07-28 server with durable tasks." \
      org.opencontainers.image.source="https://github.com/example/mcp-tasks-proxy" \
      org.opencontainers.image.licenses="Apache-2.0"

# A system user with a fixed numeric UID (Kubernetes' runAsNonRoot can only verify a numeric USER),
# no login shell and no home directory. The database directory belongs to it; it is created and chowned
# before VOLUME, because changes to a volume path after its declaration are discarded.
RUN groupadd --system --gid 10001 mcp \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin mcp \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/mcp-tasks-proxy

COPY --from=build /opt/venv /opt/venv
COPY config/docker.yaml /etc/mcp-tasks-proxy/proxy.yaml

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# SQLite task database (tasks.db plus its -wal, -shm and .lock files). One proxy process per database:
# never mount the same volume into two running containers.
VOLUME /var/lib/mcp-tasks-proxy
WORKDIR /var/lib/mcp-tasks-proxy

EXPOSE 8080 9464
USER 10001

# /healthz answers 200 while the process serves (exempt from the Host allow-list). If you move the listen
# port with MCP_TASKS_PROXY_LISTEN__PORT, override this check too (`docker run --health-cmd ...`).
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["mcp-tasks-proxy", "probe", "http://127.0.0.1:8080/healthz"]

# SIGTERM drains: /readyz turns 503, new calls get 503 with Retry-After, running tasks and calls go on to
# their end and the process exits 0 as soon as none runs, within tasks.drain_seconds (20 s); what is still
# open then gets listen.shutdown_grace_seconds (3 s). Give `docker stop` more than both (`docker stop -t 40`).
STOPSIGNAL SIGTERM
ENTRYPOINT ["mcp-tasks-proxy"]
CMD ["serve", "--config", "/etc/mcp-tasks-proxy/proxy.yaml"]
