"""`adaspec serve --ray --replicas N`: the same FastAPI app as a Ray Serve deployment.

Each replica is a Ray actor that loads one model instance and runs the app (queue, worker,
metrics and all) on it; Ray's HTTP proxy spreads requests over the replicas. Ray routes at
most `max_queue + 1` requests to a replica at a time (one decoding, the rest in its queue)
and holds up to `max_queue` more per replica itself (then answers 503). On a cluster
(`ray start --head`, `ray start --address=HEAD:6379` on the other nodes) the replicas spread
over its nodes; every node needs the models (docs/serve.md). With `--device cuda` each
replica reserves one GPU (`--gpus-per-replica`), so N replicas use N GPUs of the cluster.
Ray is imported only here, only when asked for.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from adaspec.serve.config import ServeConfig

APP_NAME = "adaspec"


def actor_options(cpus_per_replica: float, gpus_per_replica: float) -> dict:
    """What Ray reserves for each replica: CPUs, and GPUs where the models run on one (Ray
    then shows the replica only its own GPUs, so `cuda` in the replica is its GPU)."""
    options: dict = {"num_cpus": cpus_per_replica}
    if gpus_per_replica > 0:
        options["num_gpus"] = gpus_per_replica
    return options


def build_deployment(config: ServeConfig, replicas: int, cpus_per_replica: float = 1.0,
                     gpus_per_replica: float = 0.0):
    """The bound Ray Serve application: `serve.run(build_deployment(config, 2))`."""
    from ray import serve

    @serve.deployment(
        name="adaspec",
        num_replicas=replicas,
        max_ongoing_requests=config.max_queue + 1,
        max_queued_requests=max(1, config.max_queue * replicas),
        ray_actor_options=actor_options(cpus_per_replica, gpus_per_replica),
    )
    @serve.ingress()
    class AdaspecReplica:
        def __init__(self, config: ServeConfig) -> None:
            from adaspec.serve.instance import ModelInstance

            self.config = config
            self.instance = ModelInstance.load(config)

        def __serve_build_asgi_app__(self):
            from adaspec.serve.app import create_app

            return create_app(self.config, self.instance)

    # serve.deployment made the class a Deployment, but mypy ignores class decorators' types
    return AdaspecReplica.bind(config)  # type: ignore[attr-defined]  # why: class decorator


def run_ray(config: ServeConfig, replicas: int, cpus_per_replica: float = 1.0,
            gpus_per_replica: float = 0.0) -> int:
    """Start (or join, with RAY_ADDRESS) a Ray cluster, deploy N replicas behind Ray's HTTP
    proxy on --host/--port, and serve until SIGTERM or Ctrl-C."""
    import ray
    from ray import serve

    from adaspec.errors import InputError

    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    serve.start(http_options={"host": config.host, "port": config.port})
    print(f"adaspec serve: starting {replicas} Ray Serve replica(s), each loading "
          f"{config.target} ...", file=sys.stderr, flush=True)
    try:
        serve.run(build_deployment(config, replicas, cpus_per_replica, gpus_per_replica),
                  name=APP_NAME,
                  route_prefix="/")
    except RuntimeError as exc:
        serve.shutdown()
        ray.shutdown()
        raise InputError(f"Ray Serve could not start the replicas ({exc}); the replicas' "
                         "errors are printed above (prefixed by Ray)") from None
    url = f"http://{config.host}:{config.port}"
    print(f"adaspec serve: listening on {url} through Ray Serve ({replicas} replica(s); "
          f"OpenAI base_url {url}/v1, playground {url}/, model {config.served_name()!r}, "
          f"method {config.method}, {config.slots()} a replica)", file=sys.stderr,
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("adaspec serve: shutting down the Ray Serve application", file=sys.stderr,
          flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0
