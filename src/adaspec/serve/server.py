"""Run the app under uvicorn: load the models, bind, print where it listens, and on SIGTERM
(or Ctrl-C) drain: new requests are refused (the listening socket closes; a request on an
open connection gets 503) while the ones in flight, queued ones included, finish."""

from __future__ import annotations

import sys
from collections.abc import Callable

import uvicorn

from adaspec.serve.app import create_app
from adaspec.serve.config import ServeConfig
from adaspec.serve.instance import ModelInstance


class DrainingServer(uvicorn.Server):
    """uvicorn's server, plus a hook when the exit signal comes and a line once it listens."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None],
                 on_started: Callable[[str], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._on_started = on_started

    def handle_exit(self, sig, frame) -> None:  # noqa: ANN001 (signal handler signature)
        self._on_exit()
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once it has shut down (the process then dies of it);
        # here the drained server returns, closes its models and exits 0
        self._captured_signals.clear()

    async def startup(self, sockets=None) -> None:  # noqa: ANN001
        await super().startup(sockets=sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_started(f"{host}:{port}")


def listening_line(config: ServeConfig, address: str, method: str,
                   learning: str = "") -> str:
    """`learning`: what --online-distill teaches ("the draft head", "the draft")."""
    url = f"http://{address}"
    key = ", API key required" if config.api_key else ""
    learns = f", learning {learning} online" if learning else ""
    return (f"adaspec serve: listening on {url} (OpenAI base_url {url}/v1, playground {url}/, "
            f"model {config.served_name()!r}, method {method}, {config.slots()}, "
            f"queue {config.max_queue}, timeout {config.timeout:g} s{key}{learns})")


def run(config: ServeConfig, instance: ModelInstance | None = None,
        log_level: str = "info") -> int:
    if instance is None:
        print(f"adaspec serve: loading {config.target}"
              + (f" + {config.draft}" if config.draft else "") + " ...", file=sys.stderr,
              flush=True)
        instance = ModelInstance.load(config)
    app = create_app(config, instance)
    state = app.state.adaspec

    def draining() -> None:
        if state.scheduler is not None:
            if state.scheduler.draining:
                return
            state.scheduler.draining = True
        print("adaspec serve: shutting down; finishing the requests in flight", file=sys.stderr,
              flush=True)

    def started(address: str) -> None:
        online = instance.online
        learning = "" if online is None else (
            "the draft head" if online.status().get("kind") == "draft head" else "the draft")
        print(listening_line(config, address, instance.default_method, learning),
              file=sys.stderr, flush=True)

    drain = config.drain_timeout if config.drain_timeout is not None else config.timeout
    # uvicorn annotates the drain timeout int; it is asyncio.wait_for's timeout: a float works
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=log_level,
        timeout_graceful_shutdown=drain,  # type: ignore[arg-type]  # why: float is fine
        lifespan="on",
    )
    server = DrainingServer(uv_config, on_exit=draining, on_started=started)
    try:
        server.run()
    finally:
        instance.close()
    return 0 if server.started else 1
