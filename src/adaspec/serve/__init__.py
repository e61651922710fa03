"""`adaspec serve`: an OpenAI-compatible HTTP server around the speculative engine.

One module per job: `schema` (the request and response bodies), `errors` (OpenAI error
JSON), `instance` (the loaded models and one engine per method string), `scheduler` (the
bounded FIFO queue and the worker that owns the models), `batching` (that worker decoding
several requests together), `metrics` (Prometheus), `auth` (the optional API key), `history`
(the cross-request history the engines share and its file), `app` (the FastAPI app),
`server` (uvicorn, with a draining shutdown), `ray_app` (the same app as a Ray Serve
deployment), `playground/` (the page at /).

Requests decode together, a sequence each in the models' KV caches, where the runtime can
(`--max-batch`, by default 4 there); elsewhere one at a time.
"""

from adaspec.serve.config import ServeConfig

__all__ = ["ServeConfig"]
