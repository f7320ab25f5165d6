"""The ds4 HTTP server: OpenAI- and Anthropic-style APIs, metrics and a chat page over one engine worker.

`create_app(engine)` builds the Flask app (server.app); `ds4-server` (server.cli) runs it under waitress.
"""
from server.app import create_app

__all__ = ["create_app"]
