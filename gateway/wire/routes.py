"""The paths the gateway serves and the route name each has (in metrics labels and in
:mod:`gateway.request.plan`). A data module, imported by the routes and the middleware."""

from __future__ import annotations

__all__ = ["FORWARDED", "LABELS"]

# Generation routes forwarded under admission.
FORWARDED = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions",
    "/v1/responses": "responses", "/v1/messages": "messages",
    "/v1/embeddings": "embeddings", "/v1/rerank": "rerank", "/infill": "infill",
    "/completion": "completion",
}

# Every path's ``route`` label in gateway_requests_total.
LABELS = {
    **FORWARDED, "/v1/messages/count_tokens": "count_tokens", "/v1/models": "models",
    "/health": "health", "/ready": "ready", "/metrics": "metrics",
    "/status": "status", "/status.json": "status",
    "/api/chat": "ollama_chat", "/api/generate": "ollama_generate",
}
