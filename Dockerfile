# syntax=docker/dockerfile:1
# The gateway alone, in front of a llama-server (or Ollama, vLLM) you run elsewhere.
#   docker build -t llm-admission-gateway .
#   docker run --stop-timeout 40 -p 8000:8000 \
#     -v "$PWD/config.toml:/etc/gateway/config.toml:ro" llm-admission-gateway
# (--stop-timeout: longer than server.drain_timeout_s, 30 s; docker's default of 10 s
# would kill a drain under way. Podman: podman build --format docker, podman run
# --stop-timeout 40.)
# The configuration is read from /etc/gateway/config.toml: mount yours there. The example
# baked in points at 127.0.0.1:8080, which inside the container is the container itself:
# set the backends' url to an address the container reaches. GATEWAY_* variables override
# the file (docs/configuration.md).

# Build stage: the gateway and its dependencies as wheels, at the versions pyproject.toml
# allows (resolved by pip at build time).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# Run stage: the wheels installed, no build tools, an unprivileged user.
FROM python:3.11-slim
# Installing the wheels built above: their versions were resolved in the build stage.
# hadolint ignore=DL3013
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels llm-admission-gateway \
    && groupadd --system --gid 10001 gateway \
    && useradd --system --no-create-home --uid 10001 --gid 10001 gateway
COPY config.example.toml /etc/gateway/config.toml
ENV GATEWAY_SERVER__HOST=0.0.0.0 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8000
# The health check reads the same settings as the gateway (the file, then GATEWAY_*), so
# it finds the port wherever it is set. Podman keeps it only in the docker format
# (podman build --format docker); its default OCI format has no HEALTHCHECK.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["gateway", "health", "--config", "/etc/gateway/config.toml"]
ENTRYPOINT ["gateway", "serve"]
CMD ["--config", "/etc/gateway/config.toml"]
