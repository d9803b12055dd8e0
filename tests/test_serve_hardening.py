"""`kvchat serve` against hostile and broken peers (issue 46): clients that hang up early, web pages under a rebound
name, requests that name server files, a server that stops or dies under its client, SIGTERM under an ingest job.

Every race is set up from what a process is observed to do (a line it prints, a job's progress, a file appearing),
never from sleeps; loops that wait for one are bounded by `WAIT_S` and fail there. All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from cli_helpers import KVCHAT, cli_env, run_main  # noqa: E402
from test_serve import KEY, QUESTIONS, WAIT_S, Running, _ingest, _until, seeded_tiny_lm  # noqa: E402

from kvchat.config import ClientConfig  # noqa: E402
from kvchat.history.synthetic import planted_conversation  # noqa: E402
from kvchat.serve.announcement import ANNOUNCEMENT, announced_url  # noqa: E402
from kvchat.serve.client import Client, ServerFailed  # noqa: E402
from kvchat.serve.protocol import REFUSAL  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return seeded_tiny_lm(tmp_path_factory)


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_lm, encoder):
    home = tmp_path_factory.mktemp("hardened-home")
    _ingest(home, tiny_lm, encoder, "chat", seed=5)
    return home


@pytest.fixture(scope="module")
def history_dir(tmp_path_factory):
    """The operator's history directory, with one history and a link that leads out of it."""
    directory = tmp_path_factory.mktemp("histories")
    messages, _ = planted_conversation(seed=11, topics=2, turns_per_topic=8)
    (directory / "posted.json").write_text(json.dumps(messages))
    outside = directory.parent / "secret.json"
    outside.write_text(json.dumps(messages))
    (directory / "leads-out.json").symlink_to(outside)
    return directory


@pytest.fixture(scope="module")
def server(home, tiny_lm, encoder, history_dir):
    running = Running(home, tiny_lm, encoder, history_dir=str(history_dir), allowed_hosts=("kvchat.internal",))
    yield running
    running.stop()


def _job(server, started: httpx.Response) -> dict:
    assert started.status_code == 202, started.text
    path = f"/kvchat/jobs/{started.json()['id']}"
    _until(lambda: server.http("GET", path).json()["state"] in ("done", "failed"))
    return server.http("GET", path).json()


# ----------------------------------------------------------------------------------------- who may ask what


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]"])
def test_a_request_naming_a_foreign_host_is_refused(server, host):
    """DNS rebinding: a page under a name pointed at 127.0.0.1 sends that name as its Host."""
    for path in ("/v1/models", "/kvchat/conversations", "/kvchat/health"):
        refused = httpx.get(server.url + path, headers={**AUTH, "Host": host})
        assert refused.status_code == 400, (path, refused.text)
        assert "chat" not in refused.text
    assert httpx.get(server.url + "/v1/models", headers={**AUTH, "Host": "kvchat.internal"}).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={**AUTH, "Host": "localhost:1"}).status_code == 200


def test_a_web_page_cannot_post_a_simple_request(server):
    """A page may send a POST without a preflight only as text/plain or a form: refused, never parsed as JSON."""
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": QUESTIONS[0]}]})
    for kind in ("text/plain", "application/x-www-form-urlencoded"):
        sent = httpx.post(server.url + "/v1/chat/completions", content=body, headers={**AUTH, "Content-Type": kind})
        assert sent.status_code == 400, sent.text


def test_without_the_key_health_says_only_whether_it_runs_and_the_schema_is_closed(server):
    assert httpx.get(server.url + "/kvchat/health").json() == {"schema": 1, "status": "ok"}
    server.chat("chat", QUESTIONS[0], max_tokens=2)  # a resident cache the full health would name
    assert "chat" not in httpx.get(server.url + "/kvchat/health").text
    assert "chat" in server.http("GET", "/kvchat/health").text
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    schema = server.http("GET", "/openapi.json")
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    assert httpx.get(server.url + "/docs").status_code in (401, 404)


# ----------------------------------------------------------------------------------- what a client may name


def test_a_client_cannot_name_a_model(server, home):
    refused = server.http("POST", "/kvchat/ingest", json={
        "name": "evil", "history": planted_conversation(seed=1, topics=1, turns_per_topic=4)[0],
        "model": str(home / "models")})
    assert refused.status_code == 400 and "model" in refused.json()["error"]["message"]
    assert str(home) not in refused.text


@pytest.mark.parametrize("given", ["../secret.json", "/etc/passwd", "sub/../../secret.json", "leads-out.json",
                                   "..", ".", "a\\..\\secret.json"])
def test_a_history_file_outside_the_operators_directory_is_refused_alike(server, history_dir, home, given):
    refused = server.http("POST", "/kvchat/ingest", json={"name": "outside", "history_file": given})
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "history_file_not_allowed" and error["param"] == "history_file"
    for path in (str(history_dir), str(history_dir.parent), str(home)):
        assert path not in refused.text


def test_a_history_file_of_the_operators_directory_is_ingested_and_errors_name_it_as_the_client_did(
        server, history_dir, home):
    missing = server.http("POST", "/kvchat/ingest", json={"name": "nosuch", "history_file": "nosuch.json"})
    assert missing.status_code == 400 and "'nosuch.json'" in missing.json()["error"]["message"]
    assert str(history_dir) not in missing.text
    job = _job(server, server.http("POST", "/kvchat/ingest", json={
        "name": "fromfile", "history_file": "posted.json", "budget": 64, "episodes": 2}))
    assert job["state"] == "done", job["error"]
    assert job["result"]["episode_count"] == 2
    again = _job(server, server.http("POST", "/kvchat/ingest", json={"name": "fromfile",
                                                                    "history_file": "posted.json"}))
    assert again["state"] == "failed" and str(home) not in json.dumps(again)  # it exists: refused, naming no path


def test_the_http_ingest_picks_a_conversation_of_an_export(server):
    def conversation(title: str, seed: int) -> dict:
        messages, _ = planted_conversation(seed=seed, topics=1, turns_per_topic=6)
        return {"name": title, "created_at": f"2024-03-1{seed}T09:00:00Z", "chat_messages": [
            {"sender": "human" if m["role"] == "user" else "assistant", "text": m["content"],
             "created_at": f"2024-03-1{seed}T09:00:{i:02d}Z"} for i, m in enumerate(messages)]}

    export = [conversation("Garden", 1), conversation("Trip", 2)]
    unpicked = server.http("POST", "/kvchat/ingest", json={"name": "export", "history": export})
    assert unpicked.status_code == 400 and "2 Claude conversations" in unpicked.json()["error"]["message"]
    job = _job(server, server.http("POST", "/kvchat/ingest", json={
        "name": "export", "history": export, "pick": "Trip", "format": "claude", "budget": 64, "episodes": 1}))
    assert job["state"] == "done", job["error"]
    assert server.http("GET", "/kvchat/conversations/export").json()["turns"] == 6


def test_kvchat_ask_refuses_max_tokens_over_the_limit_as_chat_completions_does(server):
    over = server.config.max_tokens_limit + 1
    asked = server.http("POST", "/kvchat/ask", json={"conversation": "chat", "question": QUESTIONS[0],
                                                     "max_tokens": over})
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("model", ["chat/\u00b2", "chat/\u0661", "chat/99999999999999999999", "chat/\u2167"])
def test_an_episode_written_with_other_digits_is_404(server, model):
    refused = server.http("POST", "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 2})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert server.http("GET", f"/v1/models/{model}").status_code == 404


def test_a_lone_surrogate_in_a_question_is_answered(server):
    body = '{"model": "chat", "max_tokens": 3, "messages": [{"role": "user", "content": "Which gate \\ud800?"}]}'
    answered = server.http("POST", "/v1/chat/completions", content=body.encode(),
                           headers={"Content-Type": "application/json"})
    assert answered.status_code in (200, 400), answered.text  # answered, or refused as malformed: never a 500
    asked = server.http("POST", "/kvchat/ask", content=body.replace('"model"', '"conversation"').replace(
        '"messages": [{"role": "user", "content": ', '"question": ').replace("}]}", "}").encode(),
        headers={"Content-Type": "application/json"})
    assert asked.status_code in (200, 400), asked.text


def test_a_refusal_is_visible_to_a_plain_openai_client(server):
    off_topic = "What is the boiling point of liquid nitrogen in kelvin?"
    refused = server.chat("chat", off_topic, max_tokens=4, extra_body={"kvchat": {"refuse_off_topic": True}})
    message = refused.choices[0].message
    assert message.content == REFUSAL and message.refusal == REFUSAL
    assert refused.model_extra["kvchat"]["finish_reason"] == "refused"
    streamed = list(server.chat("chat", off_topic, max_tokens=4, stream=True,
                                extra_body={"kvchat": {"refuse_off_topic": True}}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == REFUSAL
    document = Client(server.url, api_key=KEY).ask("chat", off_topic, refuse_off_topic=True)
    assert document["answer"] == "" and document["finish_reason"] == "refused"


def test_one_log_line_per_request_never_the_question(server, caplog):
    secret = "Which gate does the secret flight leave from?"
    with caplog.at_level("INFO", logger="kvchat.serve.requests"):
        server.chat("chat", secret, max_tokens=2)
        server.http("GET", "/kvchat/conversations/nosuch")
        httpx.get(server.url + "/v1/models", headers={"Host": "evil.example"})
    lines = [r.getMessage() for r in caplog.records if r.name == "kvchat.serve.requests"]
    assert any(line.startswith("POST /v1/chat/completions 200 chat ") and line.endswith(" ms") for line in lines)
    assert any(line.startswith("GET /kvchat/conversations/nosuch 404 nosuch ") for line in lines)
    assert any(line.startswith("GET /v1/models 400 - ") for line in lines)
    assert not any("secret" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------------- a read-only home


def test_a_read_only_store_refuses_an_ingest_at_once(home, tiny_lm, encoder, read_only):
    view = read_only(home)
    running = Running(view, tiny_lm, encoder)
    try:
        body = {"name": "more", "history": planted_conversation(seed=3, topics=1, turns_per_topic=4)[0]}
        refused = running.http("POST", "/kvchat/ingest", json=body)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "read_only"
        assert running.http("DELETE", "/kvchat/conversations/chat").status_code == 403
        assert str(view) not in refused.text
        assert running.http("GET", "/kvchat/conversations/chat").status_code == 200  # still listed and asked
    finally:
        running.stop()


# ------------------------------------------------------------------------------- a slow, stopped or dead server


def test_a_server_that_accepts_and_never_answers_is_reported(tmp_path):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()  # never accepted: the kernel completes the connection, nothing reads or answers
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        client = Client(url, config=ClientConfig(connect_timeout_s=5, read_timeout_s=0.5))
        with pytest.raises(ServerFailed, match="sent nothing for 0.5 s"):
            client.conversations()
        with pytest.raises(ServerFailed, match="sent nothing"):
            client.ask("chat", "hello?", on_text=lambda piece: None)


class _CutStream(http.server.BaseHTTPRequestHandler):
    """A server that lists one conversation and dies mid-answer: its stream ends after one piece, no final event."""

    def do_GET(self) -> None:
        body = json.dumps({"schema": 1, "conversations": [{"name": "chat", "episode_count": 3}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for delta in ({"role": "assistant", "content": ""}, {"content": "Gate B"}):
            event = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.flush()  # and the connection closes: the process "died"

    def log_message(self, *args) -> None:
        pass


def test_an_answer_cut_off_by_the_servers_death_is_an_error(tmp_path):
    cut = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutStream)
    threading.Thread(target=cut.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{cut.server_address[1]}"
    try:
        with pytest.raises(ServerFailed, match="ended the answer before its end"):
            Client(url).ask("chat", "Which gate?", on_text=lambda piece: None)
        with pytest.raises(ServerFailed):
            Client(url).ask("chat", "Which gate?")  # --json's path streams too
        for args in (["Which gate?"], ["--json", "Which gate?"]):
            result = run_main(tmp_path, "ask", "--server", url, "--conversation", "chat", *args)
            assert result.returncode == 2, result
            assert len(result.stderr.splitlines()) == 1 and "ended the answer before its end" in result.stderr
    finally:
        cut.shutdown()


def test_a_stream_cut_by_the_servers_shutdown_ends_with_an_error_event(home, tiny_lm, encoder):
    running = Running(home, tiny_lm, encoder, shutdown_grace_s=0.0)
    stopped = False
    try:
        running.gate.shut()
        client = Client(running.url, api_key=KEY)
        with ThreadPoolExecutor(1) as pool:
            answering = pool.submit(client.ask, "chat", QUESTIONS[0], max_tokens=40, on_text=lambda piece: None)
            assert running.gate.holding.wait(WAIT_S)  # mid-answer
            job = running.gate.held
            running.server.should_exit = True  # as SIGTERM does
            stopped = True
            _until(lambda: job.cancelled)  # the grace (0 s) is over: the engine fails what runs
            running.gate.open()
            with pytest.raises(ServerFailed, match="shutting down"):
                answering.result(WAIT_S)
        running.thread.join(WAIT_S)
        assert not running.thread.is_alive() and not (home / ANNOUNCEMENT).exists()
    finally:
        if not stopped:
            running.stop()


# ------------------------------------------------------------------------------------- the command's process


def _serve(home: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, list[str], str]:
    """`kvchat serve --port 0 ARGS` as users run it (kvchat.cli.main), once it announced its URL; its stderr
    lines collected as they come."""
    process = subprocess.Popen([*KVCHAT, "serve", "--port", "0", "--threads", "1", *args],
                               env={**cli_env(home), **(env or {})}, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True).start()
    _until(lambda: announced_url(home) is not None or process.poll() is not None, timeout=300)
    url = announced_url(home)
    assert url is not None, "".join(lines)
    return process, lines, url


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(WAIT_S)


def test_clients_that_hang_up_early_never_kill_the_server(tmp_path):
    """Each client sends a request and closes before the reply: the server's write then meets a closed socket
    (EPIPE), which with SIGPIPE's default action killed the process within a few tries."""
    process, lines, url = _serve(tmp_path, "--no-preload", "--api-key", KEY)
    try:
        assert any("--api-key on the command line shows in the process list" in line for line in lines)
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 60
        clients = 0
        while clients < 200 and time.monotonic() < deadline and process.poll() is None:  # bounded in count and in
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as hanging_up:  # time; today's main
                hanging_up.sendall(b"GET /kvchat/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # died within ~10
            clients += 1
        assert process.poll() is None, f"killed by signal {-process.returncode} after {clients} clients"
        assert httpx.get(url + "/kvchat/health", timeout=WAIT_S).json()["status"] in ("ok", "loading")
    finally:
        _stop(process)


def test_sigterm_under_an_ingest_job_fails_it_cleanly(tmp_path, tiny_lm):
    """The job is held at its first block (a test hook) with its temp dir written; SIGTERM; the job fails, its temp
    dir goes, serve.json goes, and the process exits 143 (it aborted, 134, when torch ran in a daemon thread)."""
    home, barrier = tmp_path / "home", tmp_path / "go-on"
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    process, lines, url = _serve(home, "--no-preload", "--model", tiny_lm.spec, "--api-key-file", str(key_file),
                                 env={"KVCHAT_HOLD_AT": f"serve-ingest-block:{barrier}"})
    try:
        assert not any("process list" in line for line in lines)
        messages, _ = planted_conversation(seed=4, topics=2, turns_per_topic=8)
        started = httpx.post(url + "/kvchat/ingest", headers=AUTH, timeout=WAIT_S,
                             json={"name": "held", "history": messages, "budget": 64, "episodes": 2})
        assert started.status_code == 202, started.text
        job = f"{url}/kvchat/jobs/{started.json()['id']}"
        _until(lambda: httpx.get(job, headers=AUTH, timeout=WAIT_S).json()["progress"].get("done", 0) >= 1,
               timeout=300)  # held at its first block
        assert list((home / "caches").glob(".tmp-*")), "the ingest's temp dir should exist by now"
        process.send_signal(signal.SIGTERM)
        _until(lambda: any("the server is shutting down" in line for line in lines))  # the job was told to stop
        barrier.touch()
        process.wait(WAIT_S)
    finally:
        barrier.touch()
        _stop(process)
    stderr = "".join(lines)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "terminate called" not in stderr and "Traceback" not in stderr
    assert list((home / "caches").glob(".tmp-*")) == [] and not (home / ANNOUNCEMENT).exists()
    assert run_main(home, "list", "--json").stdout.count('"name"') == 0  # nothing half-written is visible


@pytest.mark.parametrize("how", [["--api-key", ""], ["--api-key", "  "], ["--api-key", "two words"]])
def test_an_empty_or_unusable_api_key_is_refused(tmp_path, how):
    refused = run_main(tmp_path, "serve", "--port", "0", *how)
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "API key" in refused.stderr


def test_an_empty_api_key_file_is_refused(tmp_path):
    empty = tmp_path / "key"
    empty.write_text("\n")
    refused = run_main(tmp_path, "serve", "--port", "0", "--api-key-file", str(empty))
    assert refused.returncode == 2 and "is empty" in refused.stderr, refused.stderr
    both = run_main(tmp_path, "serve", "--port", "0", "--api-key-file", str(empty), "--api-key", "k")
    assert both.returncode == 2 and "keep one" in both.stderr


def test_doctor_notices_a_stale_announcement(tmp_path):
    from test_store import _dead_pid

    home = tmp_path / "home"
    home.mkdir()
    (home / ANNOUNCEMENT).write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": _dead_pid()}))
    found = run_main(home, "doctor", "--json")
    assert found.returncode == 1
    assert [p["kind"] for p in json.loads(found.stdout)["problems"]] == ["stale-announcement"]
    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0 and not (home / ANNOUNCEMENT).exists(), fixed.stdout
    (home / ANNOUNCEMENT).write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": os.getpid()}))  # runs
    assert run_main(home, "doctor").returncode == 0
