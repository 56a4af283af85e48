"""KV-aware admission gateway for self-hosted LLM servers (llama-server first)."""

from gateway.config import Settings, load_settings
from gateway.http.app import create_app

__all__ = ["Settings", "create_app", "load_settings"]
__version__ = "0.1.0"
