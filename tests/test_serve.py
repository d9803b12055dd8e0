"""`kvchat serve` driven by real clients (the `openai` package, httpx) against real uvicorn on 127.0.0.1.

The server runs in this process (a thread) on an ephemeral port, with the tiny model already loaded, so the
tests can hold an answer at a known token (`Gate`, the engine's step hook) and see the engine's state: races
(a queue filling up, a client leaving mid-answer, a conversation removed while answered) are set up from what
the server is observed to be doing, never from sleeps.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvchat.answer.session import Session  # noqa: E402
from kvchat.answer.stops import TextGate  # noqa: E402
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, IngestConfig, Sampling, ServeConfig  # noqa: E402
from kvchat.history.synthetic import planted_conversation  # noqa: E402
from kvchat.ingest.pipeline import ingest  # noqa: E402
from kvchat.serve.announcement import ANNOUNCEMENT, write_announcement  # noqa: E402
from kvchat.serve.engine import Engine  # noqa: E402
from kvchat.serve.server import build_server  # noqa: E402
from kvchat.store import Store  # noqa: E402

KEY = "test-key"
SMALL = IngestConfig(cache=CacheConfig(budget=64, block_size=32, prefill="block"),
                     episodes=EpisodeConfig(episodes=3, patched_prompt_tokens=32))
QUESTIONS = ["Which gate does the flight leave from?", "How many tomato plants did Tom plant?",
             "What is the name of the dog?", "Where is the bakery?", "What time is the meeting?"]
WAIT_S = 60  # an upper bound on observed events; reaching it fails the test


def _ingest(home, lm, encoder, name: str, seed: int) -> None:
    messages, _ = planted_conversation(seed=seed, topics=3, turns_per_topic=8)
    path = home / f"{name}.json"
    path.write_text(json.dumps(messages))
    store = Store(home)
    try:
        ingest(path, name=name, config=replace(SMALL, model=lm.spec), store=store, lm=lm, encoder=encoder)
    finally:
        store.close()


def seeded_tiny_lm(tmp_path_factory):
    """The tiny Llama of conftest with seed 1: its greedy answers differ between questions and run past a few
    words (the default seed's answer every question with one word)."""
    from conftest import tiny_model, tiny_tokenizer

    from kvchat.model.llm import load_model

    path = tmp_path_factory.mktemp("tiny-llama-seed1")
    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer), seed=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return load_model(str(path), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return seeded_tiny_lm(tmp_path_factory)


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_lm, encoder):
    home = tmp_path_factory.mktemp("serve-home")
    _ingest(home, tiny_lm, encoder, "chat", seed=5)
    _ingest(home, tiny_lm, encoder, "trip", seed=7)
    return home


def reference(home, lm, encoder, conversation: str, question: str, max_tokens: int, **ask) -> object:
    """The answer one `Session` gives alone, in this thread: what the server must return."""
    store = Store(home)
    try:
        session = Session(store, store.get(conversation), lm, encoder, AskConfig(max_new_tokens=max_tokens))
        return session.ask(question, log=False, **ask)
    finally:
        store.close()


class Gate:
    """The engine's step hook: while shut, an answer stops at its next token until the gate opens."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.holding = threading.Event()
        self.held = None

    def shut(self) -> None:
        self.holding.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def __call__(self, job) -> None:
        if not self._open.is_set():
            self.held = job
            self.holding.set()
            self._open.wait(WAIT_S)


class Running:
    """A real uvicorn serving `home` on 127.0.0.1 in a thread of this process."""

    def __init__(self, home, lm, encoder, **settings) -> None:
        self.gate = Gate()
        self.config = ServeConfig(**{"port": 0, "api_key": KEY, "preload": False, "log": False, "model": lm.spec,
                                     **settings})
        self.engine = Engine(home, self.config, models={lm.spec: lm}, encoder=encoder, step_hook=self.gate)
        self.server = build_server(self.config, home=home, engine=self.engine)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _until(lambda: self.server.started or not self.thread.is_alive())
        assert self.server.started and self.server.url.startswith("http://127.0.0.1:")
        self.url = self.server.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def http(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=WAIT_S, **kwargs)

    def chat(self, model: str, question: str, **kwargs):
        return self.client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], **kwargs
        )

    def stop(self) -> None:
        self.gate.open()
        self.server.should_exit = True
        self.thread.join(WAIT_S)


def _until(condition, timeout: float = WAIT_S) -> None:
    """Wait for an observed condition (polling it); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def server(home, tiny_lm, encoder):
    running = Running(home, tiny_lm, encoder, queue_size=8)
    yield running
    running.stop()
    assert not (home / ANNOUNCEMENT).exists()


def test_answers_equal_the_library_streamed_or_not(server, home, tiny_lm, encoder):
    expected = reference(home, tiny_lm, encoder, "chat", QUESTIONS[0], 12)
    result = server.chat("chat", QUESTIONS[0], max_tokens=12)
    assert result.object == "chat.completion" and result.model == "chat"
    assert result.choices[0].message.content == expected.text
    assert result.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert result.usage.completion_tokens == expected.answer_tokens
    assert result.usage.prompt_tokens == expected.prompt_tokens
    assert result.usage.total_tokens == expected.prompt_tokens + expected.answer_tokens
    kvchat = result.model_extra["kvchat"]
    assert kvchat["conversation"] == "chat" and kvchat["episode"] == expected.episode
    assert kvchat["similarity"] == pytest.approx(expected.similarity, abs=1e-3)

    chunks = list(server.chat("chat", QUESTIONS[0], max_tokens=12, stream=True,
                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["kvchat"]["episode"] == expected.episode
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected.answer_tokens


def test_sources_when_the_request_asks_for_them(server, home, tiny_lm, encoder):
    expected = reference(home, tiny_lm, encoder, "chat", QUESTIONS[0], 6, sources=True)
    asked = server.chat("chat", QUESTIONS[0], max_tokens=6, extra_body={"kvchat": {"sources": True}})
    kvchat = asked.model_extra["kvchat"]
    assert kvchat["sources"] == [s.to_dict() for s in expected.sources] and kvchat["sources"]
    assert kvchat["off_topic"] == expected.off_topic
    assert "sources" not in server.chat("chat", QUESTIONS[0], max_tokens=6).model_extra["kvchat"]


def test_an_episode_model_id_skips_routing(server, home, tiny_lm, encoder):
    for episode in range(3):
        expected = reference(home, tiny_lm, encoder, "trip", QUESTIONS[1], 8, episode=episode)
        result = server.chat(f"trip/{episode}", QUESTIONS[1], max_tokens=8)
        assert result.choices[0].message.content == expected.text
        assert result.model_extra["kvchat"]["episode"] == episode


def test_earlier_messages_are_the_exchange_followed_up(server, home, tiny_lm, encoder):
    earlier = [(QUESTIONS[2], "The dog is called Rex.")]
    expected = reference(home, tiny_lm, encoder, "chat", QUESTIONS[3], 10, earlier=earlier)
    alone = reference(home, tiny_lm, encoder, "chat", QUESTIONS[3], 10)
    result = server.client.chat.completions.create(model="chat", max_tokens=10, messages=[
        {"role": "user", "content": earlier[0][0]}, {"role": "assistant", "content": earlier[0][1]},
        {"role": "user", "content": [{"type": "text", "text": QUESTIONS[3]}]},
    ])
    assert result.choices[0].message.content == expected.text
    assert result.usage.prompt_tokens == expected.prompt_tokens > alone.prompt_tokens
    assert result.model_extra["kvchat"]["episode"] == expected.episode  # routed with the exchange, as the library


def test_system_messages_are_the_clients_instructions(server, home, tiny_lm, encoder):
    instructions = "Answer in one word ."
    store = Store(home)
    try:
        config = AskConfig(max_new_tokens=10, system=instructions)
        expected = Session(store, store.get("chat"), tiny_lm, encoder, config).ask(QUESTIONS[3], log=False)
    finally:
        store.close()
    alone = reference(home, tiny_lm, encoder, "chat", QUESTIONS[3], 10)
    result = server.client.chat.completions.create(model="chat", max_tokens=10, messages=[
        {"role": "system", "content": instructions}, {"role": "user", "content": QUESTIONS[3]}])
    assert result.choices[0].message.content == expected.text
    assert result.usage.prompt_tokens == expected.prompt_tokens > alone.prompt_tokens


def test_sampling_fields_are_honoured_and_a_seed_repeats_an_answer(server, home, tiny_lm, encoder):
    store = Store(home)
    try:
        def expected(seed: int) -> str:
            config = AskConfig(max_new_tokens=10, sampling=Sampling(temperature=1.2, top_p=0.95, seed=seed,
                                                                    repetition_penalty=1.3))  # fmt: skip
            return Session(store, store.get("chat"), tiny_lm, encoder, config).ask(QUESTIONS[1], log=False).text

        answers = {}
        for seed in (1, 2, 3):
            result = server.chat("chat", QUESTIONS[1], max_tokens=10, temperature=1.2, top_p=0.95, seed=seed,
                                 extra_body={"repetition_penalty": 1.3})  # fmt: skip
            answers[seed] = result.choices[0].message.content
            assert answers[seed] == expected(seed)
        again = server.chat("chat", QUESTIONS[1], max_tokens=10, temperature=1.2, top_p=0.95, seed=2,
                            extra_body={"repetition_penalty": 1.3}, stream=True)  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == answers[2]
        assert len(set(answers.values())) > 1
    finally:
        store.close()


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"temperature": 3.0}, "temperature"),
    ({"seed": -5}, "seed"),
])
def test_what_kvchat_cannot_honour_is_a_400_with_a_reason(server, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        server.chat("chat", QUESTIONS[0], max_tokens=4, **fields)
    error = raised.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"] and len(error["message"]) < 120


def test_defaults_clients_send_are_accepted(server):
    result = server.chat("chat", QUESTIONS[0], max_tokens=3, response_format={"type": "text"}, logprobs=False,
                         n=1, frequency_penalty=0.0, presence_penalty=0.0, user="someone")  # fmt: skip
    assert result.choices[0].message.content is not None


def test_stop_strings_cut_the_answer_alike_streamed_or_not(server, home, tiny_lm, encoder):
    full = reference(home, tiny_lm, encoder, "chat", QUESTIONS[4], 24).text
    words = full.split()
    assert len(words) >= 4, f"the tiny model's answer is too short to cut: {full!r}"
    stop = " " + words[2]
    expected = full[:full.find(stop)].rstrip()
    result = server.chat("chat", QUESTIONS[4], max_tokens=24, stop=[stop, "never appears"])
    assert result.choices[0].message.content == expected and result.choices[0].finish_reason == "stop"
    streamed = server.chat("chat", QUESTIONS[4], max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_models_list_the_conversations(server):
    listed = server.client.models.list()
    assert {m.id for m in listed.data} >= {"chat", "trip"}
    assert server.client.models.retrieve("trip").model_extra["episode_count"] == 3


def test_concurrent_clients_get_their_own_answers(server, home, tiny_lm, encoder):
    asks = [(name, q) for name in ("chat", "trip") for q in QUESTIONS[:3]]
    expected = [reference(home, tiny_lm, encoder, name, q, 10).text for name, q in asks]

    def one(index: int) -> str:
        name, question = asks[index]
        if index % 2:
            stream = server.chat(name, question, max_tokens=10, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return server.chat(name, question, max_tokens=10).choices[0].message.content

    server.gate.shut()  # every request is in before the first answer goes on
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = [pool.submit(one, i) for i in range(len(asks))]
        server.gate.holding.wait(WAIT_S)
        _until(lambda: server.engine.status()["queued"] == len(asks) - 1)
        server.gate.open()
        assert [f.result(WAIT_S) for f in futures] == expected


def test_a_client_leaving_mid_answer_stops_it_and_others_are_served(server, home, tiny_lm, encoder):
    server.gate.shut()
    body = {"model": "chat", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 50,
            "stream": True}
    with httpx.Client(timeout=WAIT_S) as client:
        with client.stream("POST", server.url + "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk
            held = server.gate.holding.wait(WAIT_S)  # else say what the stream did instead
            assert held, f"the answer never reached its first token; the stream said {list(lines)}"
            job = server.gate.held
        # the client has hung up; the server notices before the held token is taken
    _until(lambda: job.cancelled)
    server.gate.open()
    assert job.wait(WAIT_S) and job.state == "cancelled"
    assert job.progress["tokens"] == 1  # the answer stopped at the token it was held at
    expected = reference(home, tiny_lm, encoder, "chat", QUESTIONS[1], 6).text
    assert server.chat("chat", QUESTIONS[1], max_tokens=6).choices[0].message.content == expected


def test_a_conversation_removed_while_answered(server, home, tiny_lm, encoder):
    _ingest(home, tiny_lm, encoder, "scratch", seed=9)
    expected = reference(home, tiny_lm, encoder, "scratch", QUESTIONS[0], 8).text
    server.gate.shut()
    with ThreadPoolExecutor(1) as pool:
        answering = pool.submit(server.chat, "scratch", QUESTIONS[0], max_tokens=8)
        assert server.gate.holding.wait(WAIT_S)
        removed = server.http("DELETE", "/kvchat/conversations/scratch")
        assert removed.status_code == 200 and removed.json()["removed"] == "scratch"
        server.gate.open()
        assert answering.result(WAIT_S).choices[0].message.content == expected  # its cache was already loaded
    with pytest.raises(openai.NotFoundError) as raised:
        server.chat("scratch", QUESTIONS[0], max_tokens=4)
    assert raised.value.body["code"] == "model_not_found"
    assert "scratch" not in {m.id for m in server.client.models.list().data}
    assert server.http("DELETE", "/kvchat/conversations/scratch").status_code == 404


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (json.dumps({"model": "chat"}).encode(), "messages"),
    (json.dumps({"model": "chat", "messages": []}).encode(), "messages"),
    (json.dumps({"model": "chat", "messages": [{"role": "assistant", "content": "hi"}]}).encode(), "messages"),
    (json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(),
     "max_tokens"),
    (json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}).encode(),
     "max_tokens"),
    (json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "n": 2}).encode(), "n"),
])
def test_a_malformed_request_is_400_in_openai_shape(server, body, param):
    response = server.http("POST", "/v1/chat/completions", content=body,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and (param is None or error["param"].startswith(param))


def test_unknown_conversation_or_episode_is_404(server):
    for model in ("nosuch", "chat/99", "chat/x"):
        with pytest.raises(openai.NotFoundError) as raised:
            server.chat(model, "hello?", max_tokens=2)
        assert raised.value.status_code == 404 and raised.value.body["code"] == "model_not_found"
    assert server.http("GET", "/v1/models/nosuch").status_code == 404
    assert server.http("GET", "/no/such/route").json()["error"]["message"]


def test_a_wrong_key_is_401_and_health_needs_none(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/kvchat/health").json() == {"schema": 1, "status": "ok"}  # nothing it holds
    health = server.http("GET", "/kvchat/health").json()
    assert health["status"] == "ok" and health["queue_size"] == 8


def test_a_body_over_the_limit_is_413(server):
    big = {"model": "chat", "messages": [{"role": "user", "content": "x" * (server.config.max_body_bytes + 1)}]}
    response = server.http("POST", "/v1/chat/completions", json=big)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: refused as it arrives
        for _ in range(server.config.max_body_bytes // 65536 + 2):
            yield b" " * 65536

    response = server.http("POST", "/v1/chat/completions", content=chunked())
    assert response.status_code == 413


def test_kvchat_ask_list_show(server, home, tiny_lm, encoder):
    expected = reference(home, tiny_lm, encoder, "trip", QUESTIONS[2], 6)
    answer = server.http("POST", "/kvchat/ask", json={"conversation": "trip", "question": QUESTIONS[2],
                                                      "max_tokens": 6}).json()
    assert answer["answer"] == expected.text and answer["episode"] == expected.episode
    assert answer["similarity"] == pytest.approx(expected.similarity, abs=1e-3) and answer["schema"] == 1
    listed = server.http("GET", "/kvchat/conversations").json()
    assert {"chat", "trip"} <= {c["name"] for c in listed["conversations"]}
    shown = server.http("GET", "/kvchat/conversations/trip").json()
    assert shown["name"] == "trip" and len(shown["episodes"]) == 3


def test_ingest_as_a_job(server, home, tiny_lm):
    messages, _ = planted_conversation(seed=11, topics=2, turns_per_topic=8)
    started = server.http("POST", "/kvchat/ingest", json={
        "name": "posted", "history": messages, "budget": 64, "episodes": 2})  # with the server's model
    assert started.status_code == 202, started.text
    job_id = started.json()["id"]
    _until(lambda: server.http("GET", f"/kvchat/jobs/{job_id}").json()["state"] in ("done", "failed"))
    job = server.http("GET", f"/kvchat/jobs/{job_id}").json()
    assert job["state"] == "done", job["error"]
    assert job["result"]["episode_count"] == 2 and job["progress"]["episodes"] == 2
    assert server.chat("posted", QUESTIONS[0], max_tokens=4).choices[0].message.content is not None
    turns = server.http("GET", "/kvchat/conversations/posted").json()["turns"]
    more, _ = planted_conversation(seed=12, topics=1, turns_per_topic=4)
    appended = server.http("POST", "/kvchat/ingest", json={"name": "posted", "history": more, "append": True})
    _until(lambda: server.http("GET", f"/kvchat/jobs/{appended.json()['id']}").json()["state"] in ("done", "failed"))
    assert server.http("GET", f"/kvchat/jobs/{appended.json()['id']}").json()["state"] == "done"
    assert server.http("GET", "/kvchat/conversations/posted").json()["turns"] == turns + len(more)
    bad = server.http("POST", "/kvchat/ingest", json={"name": "../x", "history": messages})
    assert bad.status_code == 400
    assert server.http("GET", "/kvchat/jobs/nosuch").status_code == 404


def _ingest_error(server, body: dict) -> str:
    """The message an ingest request is refused with: the 400's, or its failed job's."""
    started = server.http("POST", "/kvchat/ingest", json=body)
    if started.status_code != 202:
        assert started.status_code == 400, started.text
        return started.json()["error"]["message"]
    path = f"/kvchat/jobs/{started.json()['id']}"
    _until(lambda: server.http("GET", path).json()["state"] in ("done", "failed"))
    job = server.http("GET", path).json()
    assert job["state"] == "failed", job
    return job["error"]["message"]


def test_an_ingest_refused_names_request_fields_not_command_line_flags(server):
    """The mistakes `kvchat ingest` refuses with `--budget 20` and `--replace` (tests/test_hardening.py,
    tests/test_store.py): over HTTP the message names the request's fields, and what no request can set
    (block_size) by its key, never a flag."""
    messages, _ = planted_conversation(seed=13, topics=2, turns_per_topic=4)
    small = _ingest_error(server, {"name": "small", "history": messages, "budget": 20})
    assert 'block_size=512 is more than 8x "budget": 20' in small and "--" not in small, small
    taken = _ingest_error(server, {"name": "chat", "history": messages, "budget": 64})
    assert "conversation 'chat' exists; use \"replace\"" in taken and "--" not in taken, taken


def test_a_servers_ingest_jobs_build_with_its_weights_as_kvchat_ingest_does(tmp_path, tiny_lm, encoder):
    """An ingest job builds the caches `kvchat ingest --weights` with the server's weights builds: with int4 weights
    the library's ingest on the same model, which differ from the float model's."""
    import torch

    from kvchat.model.llm import load_model

    int4 = load_model(tiny_lm.spec, tmp_path / "int4-models", weights="int4")
    messages, _ = planted_conversation(seed=11, topics=2, turns_per_topic=8)
    config = replace(IngestConfig(model=tiny_lm.spec), cache=replace(IngestConfig().cache, budget=64),
                     episodes=replace(IngestConfig().episodes, episodes=2))  # what the job's body sets

    def caches(home):
        store = Store(home)
        try:
            return [store.load_episode(e, tiny_lm.fingerprint)[0] for e in store.get("posted").episodes]
        finally:
            store.close()

    served = {}
    for label, lm in (("float", tiny_lm), ("int4", int4)):
        home = tmp_path / label
        running = Running(home, lm, encoder, weights=lm.weights)
        try:
            started = running.http("POST", "/kvchat/ingest", json={
                "name": "posted", "history": messages, "budget": 64, "episodes": 2})
            job = f"/kvchat/jobs/{started.json()['id']}"
            _until(lambda r=running, j=job: r.http("GET", j).json()["state"] in ("done", "failed"))
            assert running.http("GET", job).json()["state"] == "done"
        finally:
            running.stop()
        served[label] = caches(home)
    history = tmp_path / "posted.json"
    history.write_text(json.dumps(messages))
    direct = Store(tmp_path / "direct")
    ingest(history, store=direct, lm=int4, name="posted", config=config, encoder=encoder)
    direct.close()
    same = lambda a, b: a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    assert all(same(ours, theirs) for ours, theirs in zip(served["int4"], caches(tmp_path / "direct"), strict=True))
    assert not all(same(ours, theirs) for ours, theirs in zip(served["int4"], served["float"], strict=True))


def test_a_full_queue_is_429(home, tiny_lm, encoder):
    running = Running(home, tiny_lm, encoder, queue_size=1)
    try:
        running.gate.shut()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(running.chat, "chat", QUESTIONS[0], max_tokens=3)
            assert running.gate.holding.wait(WAIT_S)  # answering
            second = pool.submit(running.chat, "chat", QUESTIONS[1], max_tokens=3)
            _until(lambda: running.engine.status()["queued"] == 1)  # waiting
            with pytest.raises(openai.RateLimitError) as raised:
                running.chat("chat", QUESTIONS[2], max_tokens=3)
            assert raised.value.body["code"] == "queue_full"
            running.gate.open()
            assert first.result(WAIT_S).choices and second.result(WAIT_S).choices  # none lost
    finally:
        running.stop()


@pytest.mark.parametrize("text", ["  Hello there. The END of it", "Hello ENEN END", "no stop here  \n", "END"])
def test_text_gate_releases_the_same_text_however_it_is_cut(text):
    whole = TextGate(["END", "\n\n"])
    expected = whole.feed(text) + whole.finish()
    cut = text.find("END")
    assert expected == (text if cut < 0 else text[:cut]).strip()
    for size in (1, 2, 3):
        gate = TextGate(["END", "\n\n"])
        pieces = [gate.feed(text[i:i + size]) for i in range(0, len(text), size)]
        assert "".join(pieces) + gate.finish() == expected == gate.text
        assert gate.stopped == (cut >= 0)


def test_resident_caches_are_kept_least_recently_used_within_max_memory(home, tiny_lm, encoder):
    store = Store(home)
    sizes = sorted(e.bytes for e in store.get("trip").episodes)
    store.close()
    running = Running(home, tiny_lm, encoder, max_memory=sizes[-1] + sizes[-2])  # any two episodes, not three
    try:
        reused = [running.chat(f"trip/{episode}", QUESTIONS[0], max_tokens=2).model_extra["kvchat"]["reused_cache"]
                  for episode in (0, 1, 0, 2)]
        assert reused == [False, False, True, False]
        status = running.engine.status()
        assert [(r["conversation"], r["episode"]) for r in status["resident"]] == [("trip", 0), ("trip", 2)]
        assert status["resident_bytes"] <= status["max_memory"]
    finally:
        running.stop()


def test_the_client_of_kvchat_ask_server(server, home, tiny_lm, encoder):
    from kvchat.errors import UserError
    from kvchat.serve.client import Client

    expected = reference(home, tiny_lm, encoder, "trip", QUESTIONS[4], 8)
    client = Client(server.url, api_key=KEY)
    answered = client.ask("trip", QUESTIONS[4], max_tokens=8)
    assert answered["answer"] == expected.text and answered["episode"] == expected.episode
    pieces: list[str] = []
    streamed = client.ask("trip", QUESTIONS[4], max_tokens=8, on_text=pieces.append)
    assert "".join(pieces) == streamed["answer"] == expected.text
    assert streamed["episode"] == expected.episode and streamed["answer_tokens"] == expected.answer_tokens
    assert client.ask(None, QUESTIONS[4], max_tokens=2)["conversation"] == client.conversations()[0]["name"]
    with pytest.raises(UserError, match="unknown model 'nosuch'"):
        client.ask("nosuch", "hi?", on_text=pieces.append)
    with pytest.raises(UserError, match="API key"):
        Client(server.url, api_key="wrong").ask("trip", "hi?")


def test_the_client_imports_neither_torch_nor_the_server_stack(tmp_path):
    import subprocess
    import sys

    code = ("import sys, kvchat.serve.client, kvchat.serve.announcement; "
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
    asking = ("import sys\nfrom kvchat.cli import run\n"
              "try:\n    run(['ask', '--server', 'http://127.0.0.1:9', 'hi?'])\n"
              "except SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", asking], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KVCHAT_HOME": str(tmp_path)})
    assert result.stdout.split() == ["2", "False", "False"] and "cannot reach" in result.stderr, result
    from kvchat.config import ClientConfig
    from kvchat.errors import UserError
    from kvchat.serve.client import Client

    with pytest.raises(UserError, match="cannot reach"):
        Client("http://127.0.0.1:9", config=ClientConfig(connect_timeout_s=5)).conversations()  # nothing listens


def test_follow_up_turns_longer_than_the_window_allows_are_400(server, tiny_lm):
    long = " ".join(["apple"] * (tiny_lm.context_window // 2 + 1))
    with pytest.raises(openai.BadRequestError, match="earlier messages"):
        server.client.chat.completions.create(model="chat", max_tokens=2, messages=[
            {"role": "user", "content": long}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": QUESTIONS[0]}])


# ------------------------------------------------------------------------------- the commands: serve, ask --server


def test_kvchat_ask_through_the_server(server, home, tiny_lm, encoder, monkeypatch):
    from cli_helpers import run_main

    expected = reference(home, tiny_lm, encoder, "trip", QUESTIONS[2], 6)
    question = ["--conversation", "trip", QUESTIONS[2], "--max-new-tokens", "6"]
    finished = server.engine.status()["finished"]["chat"]
    result = run_main(home, "ask", "--server", server.url, "--api-key", KEY, *question)
    assert result.returncode == 0 and result.stdout == expected.text + "\n", result.stderr
    document = json.loads(run_main(home, "ask", "--server", server.url, "--api-key", KEY, "--json", *question).stdout)
    assert document["answer"] == expected.text and document["episode"] == expected.episode
    assert server.engine.status()["finished"]["chat"] == finished + 2

    # Found through $KVCHAT_HOME/serve.json. The servers of other tests here share the home and this process's
    # pid, and the last to stop removed it: announced again as the module's server wrote it at its start.
    write_announcement(home, server.url)
    monkeypatch.setenv("KVCHAT_API_KEY", KEY)
    assert run_main(home, "ask", *question).stdout == expected.text + "\n"
    assert server.engine.status()["finished"]["chat"] == finished + 3
    assert run_main(home, "ask", "--local", "--no-log", *question).stdout == expected.text + "\n"
    assert server.engine.status()["finished"]["chat"] == finished + 3  # answered in-process

    refused = run_main(home, "ask", "--server", server.url, "--threads", "1", *question)
    assert refused.returncode == 2 and "--threads" in refused.stderr and len(refused.stderr.splitlines()) == 1
    unknown = run_main(home, "ask", "--server", server.url, "--conversation", "nosuch", "hi?")
    assert unknown.returncode == 2 and "unknown conversation" in unknown.stderr


def test_kvchat_ask_through_the_server_gives_sources_and_refuses_off_topic(server, home, tiny_lm, encoder):
    from cli_helpers import run_main

    from kvchat.cli.asking import NO_ANSWER

    expected = reference(home, tiny_lm, encoder, "chat", QUESTIONS[0], 6, sources=True)
    ask = ["ask", "--server", server.url, "--api-key", KEY, "--conversation", "chat", "--max-new-tokens", "6"]
    document = json.loads(run_main(home, *ask, "--sources", "--json", QUESTIONS[0]).stdout)
    assert document["sources"] == [s.to_dict() for s in expected.sources] and document["sources"]
    shown = run_main(home, *ask, "--sources", QUESTIONS[0])
    assert shown.returncode == 0 and shown.stdout.startswith(expected.text + "\n"), shown.stderr
    assert f"sources (episode {expected.episode}):" in shown.stdout and "tokens kept" in shown.stdout

    off_topic = "What is the boiling point of liquid nitrogen in kelvin?"
    assert reference(home, tiny_lm, encoder, "chat", off_topic, 6).off_topic
    store = Store(home)
    in_topic = store.get("chat").episodes[0].medoid_text.splitlines()[0].split(": ", 1)[1]  # a turn's own words
    store.close()
    answered = reference(home, tiny_lm, encoder, "chat", in_topic, 6)
    assert not answered.off_topic
    refused = run_main(home, *ask, "--refuse-off-topic", stdin=f"{off_topic}\n{in_topic}\n")
    assert refused.returncode == 3, refused.stderr
    assert refused.stderr.count("not answered: no episode matches") == 1
    # only the second question was answered; a batch's output lines up with its questions ([no answer] for the first)
    assert refused.stdout == f"{NO_ANSWER}\n{answered.text}\n", refused.stderr
    lines = run_main(home, *ask, "--refuse-off-topic", "--json", off_topic)
    assert lines.returncode == 3 and json.loads(lines.stdout)["finish_reason"] == "refused"


def test_the_server_checks_each_answer_and_withholds_the_unsupported_on_request(server, home, tiny_lm, encoder):
    """Through the `openai` package: every response's `kvchat` carries the answer's grounding (as a `Session` alone
    gives it); with `kvchat.grounded` an unsupported answer is withheld, which a plain client sees as an empty
    answer with finish_reason `content_filter`."""
    answers = {q: reference(home, tiny_lm, encoder, "chat", q, 12) for q in QUESTIONS}
    question, expected = next((q, a) for q, a in answers.items() if a.grounding.status == "unsupported")
    messages = [{"role": "user", "content": question}]
    plain = server.client.chat.completions.create(model="chat", messages=messages, max_tokens=12)
    assert plain.choices[0].message.content == expected.text
    assert plain.model_extra["kvchat"]["grounding"] == expected.grounding.to_dict()
    withheld = server.client.chat.completions.create(model="chat", messages=messages, max_tokens=12,
                                                     extra_body={"kvchat": {"grounded": True}})
    assert withheld.choices[0].message.content == "" and withheld.choices[0].finish_reason == "content_filter"
    assert withheld.model_extra["kvchat"]["finish_reason"] == "unsupported"
    asked = server.http("POST", "/kvchat/ask", json={"conversation": "chat", "question": question, "max_tokens": 12,
                                                     "grounded": True}).json()
    assert asked["finish_reason"] == "unsupported" and asked["answer"] == ""
    assert asked["grounding"]["unsupported"] == expected.grounding.unsupported


def test_kvchat_serve_runs_until_sigterm(tmp_path, tiny_lm, encoder):
    """The command as users run it: a process that announces itself, answers, and on SIGTERM stops cleanly."""
    import signal
    import subprocess

    from cli_helpers import KVCHAT, cli_env

    from kvchat.serve.announcement import announced_url

    home = tmp_path
    _ingest(home, tiny_lm, encoder, "chat", seed=5)
    expected = reference(home, tiny_lm, encoder, "chat", QUESTIONS[0], 6).text
    process = subprocess.Popen([*KVCHAT, "serve", "--port", "0", "--no-log", "--threads", "1"],
                               env=cli_env(home) | {"KVCHAT_API_KEY": KEY}, stderr=subprocess.PIPE, text=True)
    try:
        _until(lambda: announced_url(home) is not None or process.poll() is not None, timeout=300)
        url = announced_url(home)
        assert url is not None, process.stderr.read()
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        _until(lambda: httpx.get(url + "/kvchat/health").json()["status"] == "ok", timeout=300)  # preloaded
        answer = client.chat.completions.create(model="chat", max_tokens=6,
                                                messages=[{"role": "user", "content": QUESTIONS[0]}])
        assert answer.choices[0].message.content == expected
        process.send_signal(signal.SIGTERM)
        process.wait(WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
    stderr = process.stderr.read()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert f"serving {home} at {url}" in stderr and "Traceback" not in stderr
    assert not (home / ANNOUNCEMENT).exists()


def test_kvchat_serve_refuses_an_address_in_use(tmp_path):
    import socket

    from cli_helpers import run

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(tmp_path / "home", "serve", "--port", str(port))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "cannot listen on" in result.stderr
    assert run(tmp_path / "home", "serve", "--queue-size", "0").returncode == 2
