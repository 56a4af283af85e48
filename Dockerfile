# The gateway alone; point it at your llama-server with a mounted config.
#   docker build -t llm-admission-gateway .
#   docker run -p 8000:8000 -v $PWD/config.toml:/etc/gateway/config.toml llm-admission-gateway
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN pip install --no-cache-dir .
COPY config.example.toml /etc/gateway/config.toml
ENV GATEWAY_SERVER__HOST=0.0.0.0
EXPOSE 8000
USER nobody
CMD ["gateway", "serve", "--config", "/etc/gateway/config.toml"]
