"""`kvchat serve --replicas 2`: the app on uvicorn in this process, answers from two local Ray Serve replicas.

Its own module, as tests/test_batch_session.py is: it starts and stops a Ray of its own (skipped when one runs).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")


def _ray_serve_missing() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'kvchat[replicas]')"
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        return f"Ray Serve is not installed ({exc.name} is missing: pip install 'kvchat[replicas]')"
    return None


MISSING = _ray_serve_missing()
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=MISSING or ""), pytest.mark.xdist_group("ray")]

KEY = "test-key"
QUESTIONS = ["Which gate does the flight leave from?", "How many tomato plants did Tom plant?"]


def _home(tmp_path_factory, encoder):
    """A home with two conversations ingested by the tiny Llama (seed 1), and that model."""
    from conftest import tiny_model, tiny_tokenizer

    from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
    from kvchat.history.synthetic import planted_conversation
    from kvchat.ingest.pipeline import ingest
    from kvchat.model.llm import load_model
    from kvchat.store import Store

    path = tmp_path_factory.mktemp("tiny-llama-replicas")
    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer), seed=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    lm = load_model(str(path), tmp_path_factory.mktemp("models"))
    home = tmp_path_factory.mktemp("replicas-home")
    config = IngestConfig(model=lm.spec, cache=CacheConfig(budget=64, block_size=32, prefill="block"),
                          episodes=EpisodeConfig(episodes=2, patched_prompt_tokens=32))
    store = Store(home)
    try:
        for name, seed in (("chat", 5), ("trip", 7)):
            messages, _ = planted_conversation(seed=seed, topics=2, turns_per_topic=8)
            history = home / f"{name}.json"
            history.write_text(json.dumps(messages))
            ingest(history, name=name, config=config, store=store, lm=lm, encoder=encoder)
    finally:
        store.close()
    return home, lm


def _alone(home, lm, encoder, conversation: str, question: str, max_tokens: int) -> str:
    from kvchat.answer.session import Session
    from kvchat.config import AskConfig
    from kvchat.store import Store

    store = Store(home)
    try:
        session = Session(store, store.get(conversation), lm, encoder, AskConfig(max_new_tokens=max_tokens))
        return session.ask(question, log=False).text
    finally:
        store.close()


@pytest.mark.slow
def test_two_replicas_answer_each_conversation_from_the_replica_holding_its_caches(tmp_path_factory, encoder):
    import ray
    from ray import serve

    from kvchat.config import ServeConfig
    from kvchat.serve.replicas import replica_engine
    from kvchat.serve.server import build_server

    if ray.is_initialized():
        pytest.skip("a Ray of this process is running")
    home, lm = _home(tmp_path_factory, encoder)
    expected = {(c, q): _alone(home, lm, encoder, c, q, 12) for c in ("chat", "trip") for q in QUESTIONS}
    config = ServeConfig(port=0, api_key=KEY, log=False, threads=1, max_tokens=12)
    try:
        with replica_engine(home, config, 2) as engine:
            server = build_server(config, home=home, engine=engine)
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            deadline = time.monotonic() + 60
            while not server.started and thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.started
            try:
                client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
                asked = urllib.request.Request(server.url + "/kvchat/health",
                                               headers={"Authorization": f"Bearer {KEY}"})
                with urllib.request.urlopen(asked) as response:
                    health = json.load(response)
                assert health["status"] == "ok" and health["replicas"] == 2
                for conversation in ("chat", "trip"):
                    replicas, reused = set(), []
                    for question in (*QUESTIONS, QUESTIONS[0]):  # the last one's episode is resident by then
                        reply = client.chat.completions.create(
                            model=conversation, max_tokens=12, messages=[{"role": "user", "content": question}])
                        fields = reply.model_extra["kvchat"]
                        assert reply.choices[0].message.content == expected[(conversation, question)]
                        replicas.add(fields["replica"])
                        reused.append(fields["reused_cache"])
                    assert len(replicas) == 1, f"{conversation} was answered by {replicas}"
                    assert reused[0] is False and reused[-1] is True
                    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                        model=conversation, max_tokens=12, stream=True,
                        messages=[{"role": "user", "content": QUESTIONS[1]}]) if c.choices]
                    assert "".join(pieces) == expected[(conversation, QUESTIONS[1])]
            finally:
                server.should_exit = True
                thread.join(30)
    finally:  # whatever failed above, no Ray outlives the test
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    assert not ray.is_initialized()


def test_replicas_are_refused_below_one(tmp_path):
    from conftest import raises_said

    from kvchat.config import ServeConfig
    from kvchat.errors import UserError
    from kvchat.serve.replicas import replica_engine

    with raises_said(UserError, "--replicas must be >= 1"), replica_engine(tmp_path, ServeConfig(), 0):
        pass


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "Ray Serve 2.60's replica actor (ray::ServeReplica) starts its inter-deployment gRPC server on '[::]:0', every "
    "interface, hard-coded in ray/serve/_private/replica.py (Replica._on_initialized: add_port_to_grpc_server(..., "
    "'[::]:0')), with no option or environment variable to bind it elsewhere; Ray's own processes (GCS, raylet, "
    "workers, agents) do listen on loopback alone under RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"))
def test_the_local_ray_of_replicas_listens_on_loopback_only(tmp_path):
    """`kvchat serve --replicas 1` as users run it: every socket its process tree listens on (uvicorn's, Ray's GCS,
    raylet, workers and agents) is bound to loopback; Ray's default is every interface."""
    import ipaddress
    import signal
    import subprocess

    psutil = pytest.importorskip("psutil")
    from cli_helpers import KVCHAT, cli_env

    from kvchat.serve.announcement import announced_url

    home = tmp_path / "home"
    process = subprocess.Popen([*KVCHAT, "serve", "--replicas", "1", "--threads", "1", "--port", "0"],
                               env=cli_env(home), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while announced_url(home) is None:  # listening: the replica is deployed and Ray runs
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.1)
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        listening = set()
        for member in tree:
            try:
                listening |= {(member.name(), c.laddr.ip) for c in member.net_connections(kind="inet")
                              if c.status == psutil.CONN_LISTEN}
            except psutil.NoSuchProcess:
                continue
        assert listening and len(tree) > 2, (listening, tree)  # Ray's processes were seen
        outside = {(name, ip) for name, ip in listening
                   if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback}
        assert not outside, f"listening beyond loopback: {sorted(outside)}"
        process.send_signal(signal.SIGTERM)
        process.wait(120)
        assert process.returncode == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(60)
