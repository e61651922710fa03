"""`adaspec serve --ray`: the same app as a Ray Serve deployment with 2 replicas (one model
instance each) behind Ray's HTTP proxy, on tiny models, loopback only. Skips without Ray."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install -e '.[ray]'")
httpx = pytest.importorskip("httpx", reason="needs httpx: pip install -e '.[dev]'")

from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from adaspec.serve.config import ServeConfig  # noqa: E402

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_url(model_dirs, tmp_path_factory):
    import ray
    from ray import serve

    from adaspec.serve.ray_app import APP_NAME, build_deployment

    target, draft = model_dirs
    port = free_port()
    config = ServeConfig(method="draft:k=3", target=target, draft=draft, dtype="float32",
                         weights="none", draft_weights="none", model_name=MODEL, port=port,
                         max_queue=4)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")),
             runtime_env={"env_vars": {"ADASPEC_HOME": str(tmp_path_factory.mktemp("h"))}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_deployment(config, replicas=2, cpus_per_replica=0.5), name=APP_NAME,
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_behind_rays_proxy(ray_url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=ray_url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12,
                                    temperature=0)
    assert out.usage.completion_tokens == 12
    assert out.usage.model_extra["speculation"]["method"] == "draft:k=3"

    # every replica decodes the same greedy text; both take requests
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: httpx.post(ray_url + "/v1/completions", json=body,
                                                     timeout=60), range(8)))
    assert {a.status_code for a in answers} == {200}
    assert {a.json()["choices"][0]["text"] for a in answers} == {out.choices[0].text}
    # both replicas run (asked of Ray Serve itself: which replica the proxy picks for a
    # request is Ray's choice, so no probe through it can tell)
    from ray import serve

    from adaspec.serve.ray_app import APP_NAME

    deployments = serve.status().applications[APP_NAME].deployments.values()
    assert sum(d.replica_states.get("RUNNING", 0) for d in deployments) == 2
    assert httpx.get(ray_url + "/health").json()["pid"] > 0

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
