"""Fuzzing (issue 46): the HTTP API of `kvchat serve` and every history reader, fed what hypothesis makes of their
input's shape. No request gets a 500 or logs a traceback, no reader raises anything but one line (UserError), and
nothing hangs. Bounded by example counts (`max_examples`, no deadline): the whole file runs in well under a minute.

The HTTP side goes through the ASGI app in this process (Starlette's TestClient), on the tiny model, with answers of
a few tokens; a valid request is answered or queued like any other.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvchat.errors import UserError
from kvchat.history.loading import FORMAT_NAMES, load_history, parse_history

FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ----------------------------------------------------------------------------------------------- the values

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30))  # what JSON can hold
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                           max_leaves=12)
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\ud800", "\x00", "\u202e", "Which gate?", "²"]))
roles = st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "human", ""]), st.text(max_size=8))


def _maybe(strategy, junk=json_values):
    """The field's own kind of value most of the time, any JSON value sometimes."""
    return st.one_of(strategy, strategy, junk)


messages = st.lists(st.fixed_dictionaries({"role": _maybe(roles), "content": _maybe(texts)},
                                          optional={"time": _maybe(texts), "name": texts}), max_size=5)

# ------------------------------------------------------------------------------------------------ readers

chatgpt = st.fixed_dictionaries({"mapping": _maybe(st.dictionaries(
    st.text(max_size=4), st.fixed_dictionaries({}, optional={
        "message": _maybe(st.fixed_dictionaries({"author": _maybe(st.fixed_dictionaries({"role": _maybe(roles)})),
                                                 "content": _maybe(st.fixed_dictionaries({
                                                     "content_type": st.sampled_from(["text", "code", "x"]),
                                                     "parts": _maybe(st.lists(_maybe(texts), max_size=3))})),
                                                 "create_time": _maybe(st.floats(0, 2e9))})),
        "parent": _maybe(st.text(max_size=4)), "children": _maybe(st.lists(st.text(max_size=4), max_size=3))}),
    max_size=5))}, optional={"title": _maybe(texts), "current_node": _maybe(st.text(max_size=4)),
                             "create_time": _maybe(st.floats(0, 2e9))})
claude = st.fixed_dictionaries({"chat_messages": _maybe(st.lists(st.fixed_dictionaries(
    {"sender": _maybe(st.sampled_from(["human", "assistant", "x"])), "text": _maybe(texts)},
    optional={"created_at": _maybe(texts), "content": _maybe(st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image"]), "text": _maybe(texts)}), max_size=2))}), max_size=5))},
    optional={"name": _maybe(texts), "created_at": _maybe(texts)})
locomo_turns = st.lists(st.fixed_dictionaries({"speaker": _maybe(texts), "text": _maybe(texts)},
                                              optional={"dia_id": _maybe(texts)}), max_size=4)
locomo = st.fixed_dictionaries({"conversation": _maybe(st.fixed_dictionaries(
    {"speaker_a": _maybe(texts), "speaker_b": _maybe(texts), "session_1": _maybe(locomo_turns)},
    optional={"session_1_date_time": _maybe(texts), "session_2": _maybe(locomo_turns),
              "session_3_date_time": _maybe(texts)}))}, optional={"qa": json_values, "sample_id": texts})
longmemeval = st.fixed_dictionaries({"haystack_sessions": _maybe(st.lists(_maybe(messages), max_size=3))},
                                    optional={"haystack_dates": _maybe(st.lists(_maybe(texts), max_size=3))})
telegram_text = _maybe(st.one_of(texts, st.lists(st.one_of(texts, st.fixed_dictionaries(
    {"type": st.sampled_from(["plain", "bold", "link", "x"]), "text": _maybe(texts)})), max_size=3)))
telegram_chat = st.fixed_dictionaries({"messages": _maybe(st.lists(st.fixed_dictionaries(
    {"type": _maybe(st.sampled_from(["message", "service", "x"])), "text": telegram_text},
    optional={"id": _maybe(st.integers(0, 10**6)), "from": _maybe(texts), "date": _maybe(texts)}), max_size=5))},
    optional={"name": _maybe(texts), "type": _maybe(st.sampled_from(["personal_chat", "private_group", "x"])),
              "id": _maybe(st.integers(0, 10**10))})
telegram = st.one_of(telegram_chat, st.fixed_dictionaries({"chats": _maybe(st.fixed_dictionaries(
    {"list": _maybe(st.lists(telegram_chat, max_size=3))}))}))
slack = st.lists(st.fixed_dictionaries({"type": _maybe(st.sampled_from(["message", "x"])), "text": _maybe(texts)},
    optional={"subtype": _maybe(st.sampled_from(["channel_join", "bot_message", "me_message", "file_share",
                                                 "thread_broadcast", "x"])),
              "user": _maybe(st.sampled_from(["U01DANA", "U02SAM", ""])), "ts": _maybe(st.sampled_from(
                  ["1683554161.000200", "0", "x", ""])), "username": _maybe(texts),
              "user_profile": _maybe(st.fixed_dictionaries({}, optional={"real_name": _maybe(texts),
                                                                          "display_name": _maybe(texts)})),
              "bot_profile": _maybe(st.fixed_dictionaries({}, optional={"name": _maybe(texts)}))}), max_size=5)
discord = st.fixed_dictionaries({"messages": _maybe(st.lists(st.fixed_dictionaries(
    {"type": _maybe(st.sampled_from(["Default", "Reply", "GuildMemberJoin", "x"])), "content": _maybe(texts),
     "author": _maybe(st.fixed_dictionaries({}, optional={"name": _maybe(texts), "nickname": _maybe(texts)}))},
    optional={"id": _maybe(texts), "timestamp": _maybe(texts), "attachments": _maybe(st.lists(json_values,
                                                                                            max_size=2))}),
    max_size=5))}, optional={"guild": _maybe(st.fixed_dictionaries({"name": _maybe(texts)})),
                             "channel": _maybe(st.fixed_dictionaries({"name": _maybe(texts)}))})
histories = st.one_of(json_values, messages, st.fixed_dictionaries({"messages": _maybe(messages)}),
                      chatgpt, st.lists(chatgpt, max_size=3), claude, st.lists(claude, max_size=3), locomo,
                      st.lists(locomo, max_size=3), longmemeval, telegram, slack, discord)
picks = st.one_of(st.none(), st.integers(-1, 4), st.sampled_from(["all", "1", "", "Trip"]), texts)
json_formats = st.sampled_from([None, "openai", "chatgpt", "claude", "telegram", "slack", "discord", "locomo",
                                 "longmemeval", "jsonl"])


def _check_read(read) -> None:
    """`read()` gives turns of valid text, or refuses in one line; anything else fails the test."""
    try:
        turns = read()
    except UserError as exc:
        assert "\n" not in str(exc) and str(exc), repr(exc)
        return
    assert turns
    for turn in turns:
        for value in (turn.role, turn.text, turn.time, turn.turn_id, turn.conversation_title):
            if value is not None:
                value.encode("utf-8")  # no lone surrogate left


@FUZZ
@given(history=histories, format=json_formats, pick=picks)
def test_every_json_reader_reads_or_refuses_in_one_line(history, format, pick):
    _check_read(lambda: parse_history(history, "fuzzed.json", format=format, pick=pick))


transcript_lines = st.one_of(st.builds(lambda n, t: f"{n}: {t}", st.text(max_size=10), texts),
                             st.builds(lambda d, n, t: f"[{d}] {n}: {t}", st.text(max_size=12), texts, texts),
                             st.builds(json.dumps, st.one_of(json_values, messages,
                                                             st.fixed_dictionaries({"messages": messages}))),
                             st.builds(lambda n, t: f"**{n}:** {t}", st.text(max_size=10), texts),  # markdown
                             st.builds(lambda h, n: f"{h} {n}", st.sampled_from(["#", "##", "###"]),
                                       st.text(max_size=10)),
                             st.sampled_from(["```", "~~~", "---", "***", ""]),
                             st.text(max_size=30))
text_files = st.builds("\n".join, st.lists(transcript_lines, max_size=6))


@FUZZ
@given(text=text_files, format=st.sampled_from([None, "transcript", "markdown", "jsonl", "finetune",
                                                                 "openai"]), pick=picks)
def test_every_text_reader_reads_or_refuses_in_one_line(tmp_path_factory, text, format, pick):
    path = tmp_path_factory.mktemp("fuzz") / "history.txt"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _check_read(lambda: load_history(path, format=format, pick=pick))


def test_the_fuzz_covers_every_format():
    assert set(FORMAT_NAMES) <= {"openai", "chatgpt", "claude", "telegram", "slack", "discord", "locomo",
                                 "longmemeval", "jsonl", "finetune", "transcript", "markdown"}, \
        "a new reader: give it a strategy here"


# ------------------------------------------------------------------------------------------------ the API

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def api(tmp_path_factory, tiny_lm, encoder):
    """kvchat serve's app over a home holding conversation "chat", in this process (lifespan and worker run)."""
    pytest.importorskip("fastapi")
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from kvchat.config import IngestConfig, ServeConfig
    from kvchat.history.synthetic import planted_conversation
    from kvchat.ingest.pipeline import ingest
    from kvchat.serve.app import create_app
    from kvchat.serve.engine import Engine
    from kvchat.store import Store

    home = tmp_path_factory.mktemp("fuzz-home")
    history = home.parent / "chat.json"
    history.write_text(json.dumps(planted_conversation(seed=5, topics=2, turns_per_topic=6)[0]))
    store = Store(home)
    small = replace(IngestConfig(model=tiny_lm.spec), cache=replace(IngestConfig().cache, budget=64))
    ingest(history, name="chat", config=small, store=store, lm=tiny_lm, encoder=encoder)
    store.close()
    config = ServeConfig(api_key=KEY, preload=False, log=False, model=tiny_lm.spec, max_tokens=3, queue_size=64,
                         history_dir=str(home.parent))
    engine = Engine(home, config, models={tiny_lm.spec: tiny_lm}, encoder=encoder)
    with TestClient(create_app(config, home=home, engine=engine), base_url="http://127.0.0.1",
                    raise_server_exceptions=False) as client:
        yield client, engine


def _post(client, path: str, body: object):
    """`body` as JSON text (ASCII: a lone surrogate travels as its escape, as any JSON encoder writes it)."""
    return client.post(path, content=json.dumps(body).encode(), headers={**AUTH, "Content-Type": "application/json"})


def _answered_well(response) -> None:
    """No 500; an error in OpenAI's shape; a stream that ends with `[DONE]` or one error event."""
    assert response.status_code < 500, response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
        assert events[-1] == "[DONE]" or "error" in json.loads(events[-1]), events[-3:]
        return
    document = response.json()
    if response.status_code >= 400:
        assert set(document["error"]) == {"message", "type", "param", "code"}, document


@pytest.fixture
def no_tracebacks(caplog):
    with caplog.at_level(logging.ERROR, logger="kvchat"):
        yield
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


max_tokens = st.one_of(st.integers(-2, 4), json_values)
questions = st.one_of(st.sampled_from(["Which gate does the flight leave from?", "What is the dog called?", "²?",
                                       "Which gate\ud800?", "\u202eWhich gate?\x85"]),
                      st.text(min_size=1, max_size=40))
valid_messages = st.builds(  # earlier user/assistant pairs, then the question: what clients send
    lambda pairs, question: [m for asked, said in pairs for m in ({"role": "user", "content": asked},
                                                                   {"role": "assistant", "content": said})]
    + [{"role": "user", "content": question}], st.lists(st.tuples(texts, texts), max_size=2), questions)
valid_chat = st.fixed_dictionaries(
    {"model": st.sampled_from(["chat", "chat/0", "chat/1"]), "messages": valid_messages,
     "max_tokens": st.integers(1, 3)},
    optional={"stream": st.booleans(), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
              "kvchat": st.fixed_dictionaries({}, optional={"sources": st.booleans(),
                                                            "refuse_off_topic": st.booleans()}),
              "temperature": st.floats(0, 2)})
near_chat = st.fixed_dictionaries(
    {"model": _maybe(st.sampled_from(["chat", "chat/0", "chat/1", "chat/9", "nosuch", "chat/²", "chat/-1", "/",
                                      "chat/0/0"])),
     "messages": _maybe(messages)},
    optional={"max_tokens": max_tokens, "max_completion_tokens": max_tokens, "stream": _maybe(st.booleans()),
              "stop": _maybe(st.one_of(texts, st.lists(texts, max_size=6))), "n": _maybe(st.integers(0, 2)),
              "stream_options": _maybe(st.fixed_dictionaries({"include_usage": _maybe(st.booleans())})),
              "kvchat": _maybe(st.fixed_dictionaries({}, optional={"sources": _maybe(st.booleans()),
                                                                   "refuse_off_topic": _maybe(st.booleans())})),
              "temperature": json_values})
chat_bodies = st.one_of(valid_chat, valid_chat, near_chat, json_values)  # half of them answered
VALID_CHAT = {"model": "chat", "messages": [{"role": "user", "content": "Which gate?"}], "max_tokens": 2}


@FUZZ
@given(body=chat_bodies)
@example(body=VALID_CHAT)
@example(body={**VALID_CHAT, "stream": True, "kvchat": {"sources": True, "refuse_off_topic": True}})
def test_chat_completions_never_fail_inside(api, no_tracebacks, body):
    client, _ = api
    response = _post(client, "/v1/chat/completions", body)
    _answered_well(response)
    if body in (VALID_CHAT,):
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None


valid_ask = st.fixed_dictionaries({"conversation": st.just("chat"), "question": questions,
                                   "max_tokens": st.integers(1, 3)},
                                  optional={"episode": st.integers(0, 1), "sources": st.booleans(),
                                            "refuse_off_topic": st.booleans()})
ask_bodies = st.one_of(valid_ask, valid_ask, json_values, st.fixed_dictionaries(
    {"conversation": _maybe(st.sampled_from(["chat", "nosuch", "", "chat/0"])), "question": _maybe(texts)},
    optional={"episode": _maybe(st.integers(-1, 3)), "max_tokens": max_tokens, "sources": _maybe(st.booleans()),
              "refuse_off_topic": _maybe(st.booleans())}))


@FUZZ
@given(body=ask_bodies)
@example(body={"conversation": "chat", "question": "Which gate?", "max_tokens": 2})
def test_kvchat_ask_never_fails_inside(api, no_tracebacks, body):
    client, _ = api
    response = _post(client, "/kvchat/ask", body)
    _answered_well(response)
    if body == {"conversation": "chat", "question": "Which gate?", "max_tokens": 2}:
        assert response.status_code == 200 and response.json()["conversation"] == "chat"


turn_texts = st.one_of(st.sampled_from(["We land in Tokyo on May 3rd.", "The gate is B12.", "\ud800", "\u202e!"]),
                       st.text(min_size=1, max_size=30))
valid_history = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                "content": turn_texts}), min_size=2, max_size=8)
valid_ingest = st.fixed_dictionaries({"name": st.sampled_from(["fuzzed", "fuzzed-2"]), "history": valid_history,
                                      "replace": st.just(True), "budget": st.integers(64, 96),
                                      "episodes": st.integers(1, 2)})
ingest_bodies = st.one_of(valid_ingest, json_values, st.fixed_dictionaries(
    {"name": _maybe(st.sampled_from(["fuzzed", "chat", "../x", "", "a" * 101, "CON", "Chat"]))},
    optional={"history": _maybe(histories), "history_file": _maybe(st.sampled_from(
                  ["chat.json", "../chat.json", "/etc/passwd", "nosuch.json", "", "fuzz-home"])),
              "format": _maybe(st.sampled_from([*FORMAT_NAMES, "nosuch"])), "pick": picks,
              "replace": _maybe(st.booleans()), "append": _maybe(st.booleans()),
              "budget": _maybe(st.integers(-1, 64)), "episodes": _maybe(st.integers(-1, 3)),
              "method": _maybe(st.sampled_from(["epicache", "recall", "full", "nosuch"])), "model": texts}))
VALID_INGEST = {"name": "fuzzed", "history_file": "chat.json", "replace": True, "budget": 64, "episodes": 1}


@settings(FUZZ, max_examples=30)
@given(body=ingest_bodies)
@example(body=VALID_INGEST)
def test_ingest_never_fails_inside(api, no_tracebacks, body):
    client, engine = api
    response = _post(client, "/kvchat/ingest", body)
    _answered_well(response)
    if body == VALID_INGEST:
        assert response.status_code == 202, response.text
    if response.status_code == 202:
        job = engine.job(response.json()["id"])
        job.wait(120)  # the worker takes it next: a bounded wait on observed progress, never a timing claim
        assert job.finished and (job.error is None or isinstance(job.error, UserError)), repr(job.error)
        if body == VALID_INGEST:
            assert job.state == "done", repr(job.error)


paths = st.one_of(st.text(max_size=20), st.sampled_from(["chat", "nosuch", "..", "%2e%2e", "chat/0", "²", "\x00"]))


@FUZZ
@given(method=st.sampled_from(["GET", "DELETE", "POST", "PUT"]),
       route=st.sampled_from(["/v1/models/{}", "/kvchat/conversations/{}", "/kvchat/jobs/{}", "/{}",
                              "/kvchat/{}", "/v1/chat/completions/{}"]),
       part=paths, raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_any_path_and_body_never_fail_inside(api, no_tracebacks, method, route, part, raw):
    client, _ = api
    if method == "DELETE" and "conversations" in route and part == "chat":
        part = "not-chat"  # the fuzz keeps the conversation the other examples ask
    url = route.format(urllib.parse.quote(part, safe=""))
    response = client.request(method, url, content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code < 500, (method, url, response.text)


def test_the_fuzzed_home_still_answers(api, tiny_lm):
    client, _ = api
    answered = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": "chat", "messages": [{"role": "user", "content": "Which gate?"}], "max_tokens": 2})
    assert answered.status_code == 200, answered.text
    assert Path(tiny_lm.spec).exists()
