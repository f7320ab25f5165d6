"""Server-sent events: framing and the streamed Flask response.

Owns: `frame` (one SSE event: optional `event:` line, one `data:` line, blank line), `KEEPALIVE` (an SSE comment
line, which every SSE client ignores, sent while a stream waits: in the queue or during a long prefill) and `stream` (a
text/event-stream response over a generator of frames). When the response ends early, because the client
disconnected and the WSGI server closed the iterator or because the generator saw the disconnect while
waiting, the job is cancelled so the worker moves on to the next request.
"""
from __future__ import annotations

import json

from flask import Response

__all__ = ["frame", "stream", "DONE", "KEEPALIVE"]

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"


def frame(data, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def stream(frames, job) -> Response:
    def body():
        try:
            yield from frames
        finally:
            job.cancel()                      # a no-op once the job is done; frees the worker otherwise
            frames.close()

    return Response(body(), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
