"""The history formats beyond OpenAI messages, LoCoMo and LongMemEval: ChatGPT and Claude exports, fine-tune
JSONL and plain transcripts; detection, --format, pick, and refusals that name every format."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.cli.words import error_text
from kvchat.errors import UserError
from kvchat.history.formats.common import EXAMPLES
from kvchat.history.loading import FORMAT_NAMES, Turn, format_turns, load_history, parse_history

DATA = Path(__file__).parent / "data"
GOOD = DATA / "good"
EXAMPLE_FILES = Path(__file__).parents[1] / "examples"
CHATGPT = GOOD / "chatgpt_export.json"
CLAUDE = GOOD / "claude_export.json"
FINETUNE = GOOD / "finetune.jsonl"


def _refusal(exc: pytest.ExceptionInfo[UserError]) -> str:
    """The message as the CLI says it, checked to be one line naming every format and the README's examples."""
    text = error_text(exc.value)
    assert text.splitlines() == [text], f"not one line: {text!r}"
    for name in ("OpenAI messages list", "JSONL", "fine-tune", "ChatGPT", "Claude", '"Name: text" transcript',
                 "LoCoMo", "LongMemEval", EXAMPLES):
        assert name in text, f"{name!r} not in {text!r}"
    return text


def _said(turns: list[Turn]) -> list[tuple[str, str, str | None, str | None]]:
    """What turns say, where and when, without the ids receipts name them by."""
    return [(t.role, t.text, t.time, t.conversation_title) for t in turns]


def _one_line(exc: pytest.ExceptionInfo[UserError]) -> str:
    text = error_text(exc.value)
    assert text.splitlines() == [text], f"not one line: {text!r}"
    return text


# ---------------------------------------------------------------------------------------------------------
# ChatGPT export


def test_chatgpt_visible_branch_without_hidden_system_and_tool_messages() -> None:
    turns = load_history(CHATGPT, pick="Trip to Japan")
    assert [(t.role, t.text) for t in turns] == [
        ("user", "I'm going to Tokyo in October. My hotel confirmation number is KX-4471."),
        ("assistant", "Great! Keep KX-4471 handy at check-in."),
        ("user", "How much is 120 euros in yen?"),  # the image part is dropped, the text part kept
        ("assistant", "About 19,380 yen."),  # the python call and its output are left out
    ]  # the edited-away branch ("What is the weather like?") is not on current_node's chain
    assert [t.time for t in turns] == ["2023-05-08 13:56 UTC"] * 2 + ["2023-05-08 13:58 UTC"] * 2
    assert {t.conversation_title for t in turns} == {"Trip to Japan"}


def test_chatgpt_pick_by_title_number_and_all() -> None:
    japan = load_history(CHATGPT, pick="Trip to Japan")
    assert load_history(CHATGPT, pick="  trip to JAPAN ") == japan  # titles match without case or edge spaces
    assert load_history(CHATGPT, pick=1) == japan == load_history(CHATGPT, pick="1")
    tomato = load_history(CHATGPT, pick=2)
    assert [t.text for t in tomato] == ["I planted 20 tomato plants today.",
                                        "Twenty is a lot! Water them every morning."]
    both = load_history(CHATGPT, pick="all")
    assert _said(both) == _said(tomato + japan)  # oldest conversation first, whatever the file's order
    assert [t.turn_id for t in both] == ["Tomato plants, turn 1", "Tomato plants, turn 2", "Trip to Japan, turn 1",
                                         "Trip to Japan, turn 2", "Trip to Japan, turn 3", "Trip to Japan, turn 4"]
    lines = format_turns(both)
    assert lines[0].startswith("[conversation: Tomato plants]\n[2023-05-05 13:56 UTC]\nuser: I planted")
    assert lines[2].startswith("[conversation: Trip to Japan]\n[2023-05-08 13:56 UTC]\nuser: I'm going")
    assert sum(line.count("[conversation: ") for line in lines) == 2


def test_chatgpt_needs_a_pick_and_names_the_conversations() -> None:
    with pytest.raises(UserError) as exc:
        load_history(CHATGPT)
    text = _one_line(exc)
    assert "holds 2 ChatGPT conversations" in text and '1 "Trip to Japan"' in text and "--pick" in text


@pytest.mark.parametrize(("pick", "expected"), [
    ("Japan", 'no conversation titled "Japan" (titles containing it: 1 "Trip to Japan")'),
    ("Paris", 'no conversation titled "Paris"'),
    (3, "has no conversation 3: it holds 2"),
    ("0", "has no conversation 0"),
])
def test_chatgpt_bad_pick(pick: int | str, expected: str) -> None:
    with pytest.raises(UserError) as exc:
        load_history(CHATGPT, pick=pick)
    assert expected in _one_line(exc)


def test_chatgpt_single_conversation_object_needs_no_pick(tmp_path: Path) -> None:
    export = json.loads(CHATGPT.read_text())
    path = tmp_path / "one.json"
    path.write_text(json.dumps(export[1]))
    assert load_history(path) == load_history(CHATGPT, pick=2)
    path.write_text(json.dumps(export[:1]))  # an export of one conversation
    assert load_history(path) == load_history(CHATGPT, pick=1)


def test_chatgpt_without_current_node_takes_the_latest_leaf() -> None:
    export = json.loads(CHATGPT.read_text())
    del export[0]["current_node"]
    assert parse_history(export, pick=1) == load_history(CHATGPT, pick=1)


def _broken_chatgpt(change: str) -> list[dict]:
    export = json.loads(CHATGPT.read_text())
    mapping = export[0]["mapping"]
    if change == "no mapping":
        del export[0]["mapping"]
    elif change == "current node missing":
        export[0]["current_node"] = "nope"
    elif change == "parent missing":
        mapping["aaa4-u1"]["parent"] = "gone"
    elif change == "cycle":
        mapping["aaa1-root"]["parent"] = "aab1-a2"
    elif change == "no author":
        del mapping["aaa4-u1"]["message"]["author"]
    elif change == "parts not list":
        mapping["aaa4-u1"]["message"]["content"]["parts"] = "hi"
    return export


@pytest.mark.parametrize(("change", "expected"), [
    ("no mapping", 'conversation 1 has no "mapping"'),
    ("current node missing", '"current_node" that is not in its "mapping"'),
    ("parent missing", 'has a parent that is not in its "mapping" ("gone")'),
    ("cycle", "is its own ancestor"),
    ("no author", 'node "aaa4-u1" has no "author"."role"'),
    ("parts not list", '"parts" that is a string'),
])
def test_chatgpt_malformed(change: str, expected: str) -> None:
    with pytest.raises(UserError) as exc:
        parse_history(_broken_chatgpt(change), "conversations.json", format="chatgpt", pick=1)
    text = _refusal(exc)
    assert text.startswith("conversations.json: ") and expected in text


def test_zip_export_is_refused_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "chatgpt-export.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("conversations.json", CHATGPT.read_text())
    with pytest.raises(UserError) as exc:
        load_history(path)
    assert "zip archive" in _refusal(exc) and "conversations.json" in str(exc.value)


# ---------------------------------------------------------------------------------------------------------
# Claude export


def test_claude_roles_text_blocks_and_times() -> None:
    turns = load_history(CLAUDE, pick="sourdough starter")
    assert [(t.role, t.text, t.time) for t in turns] == [
        ("user", "My starter is called Gerald and I feed it at 8am.", "2024-03-12 09:00 UTC"),
        ("assistant", "Gerald sounds healthy. Feed him 1:1:1 flour, water, starter.", "2024-03-12 09:00 UTC"),
        ("user", "How long until it doubles?", "2024-03-12 09:02 UTC"),  # the attachment-only message is left out
        ("assistant", "Usually 4 to 8 hours at room temperature.", "2024-03-12 09:02 UTC"),
    ]  # the thinking block is not the chat
    assert {t.conversation_title for t in turns} == {"Sourdough starter"}


def test_claude_pick_number_and_all_in_time_order() -> None:
    bike = load_history(CLAUDE, pick=2)
    assert [t.role for t in bike] == ["user", "assistant"] and "700x28c" in bike[0].text
    assert _said(load_history(CLAUDE, pick="all")) == _said(bike + load_history(CLAUDE, pick=1))
    with pytest.raises(UserError) as exc:
        load_history(CLAUDE)
    assert "holds 2 Claude conversations" in _one_line(exc)


def test_claude_text_without_content_blocks(tmp_path: Path) -> None:
    """Older exports have only "text"."""
    export = json.loads(CLAUDE.read_text())
    for message in export[1]["chat_messages"]:
        del message["content"]
    assert parse_history(export, pick=2) == load_history(CLAUDE, pick=2)


@pytest.mark.parametrize(("sender", "expected"), [
    (None, 'message 1 has no (expected "sender": "human" or "assistant")'),
    ("robot", 'message 1 has the sender "robot"'),
    (["human"], "message 1 has a sender that is a list"),
])
def test_claude_bad_sender(sender: object, expected: str) -> None:
    export = json.loads(CLAUDE.read_text())
    export[1]["chat_messages"][0]["sender"] = sender
    with pytest.raises(UserError) as exc:
        parse_history(export, "c.json", pick=2)
    assert expected in _refusal(exc)


# ---------------------------------------------------------------------------------------------------------
# OpenAI fine-tune JSONL


def test_finetune_pick_one_or_all() -> None:
    second = load_history(FINETUNE, pick=2)
    assert [(t.role, t.text) for t in second] == [  # the system prompt told the tuned model what to be: left out
        ("user", "Which terminal for TP 441?"), ("assistant", "Terminal 1.")]
    assert all(t.conversation_title is None and t.turn_id is None for t in second)  # one conversation
    every = load_history(FINETUNE, pick="all")
    assert [t.text for t in every] == [t.text for n in (1, 2, 3) for t in load_history(FINETUNE, pick=n)]
    assert [t.turn_id for t in every[:3]] == ["#1, turn 1", "#1, turn 2", "#2, turn 1"]  # what receipts name
    assert [line.split("\n")[0] for line in format_turns(every) if line.startswith("[conversation")] == [
        "[conversation: #1]", "[conversation: #2]", "[conversation: #3]"]


@pytest.mark.parametrize(("pick", "expected"), [
    (None, "holds 3 fine-tune JSONL conversations"),
    ("Lisbon", "fine-tune JSONL conversations have no titles; choose one by number (1 to 3)"),
])
def test_finetune_bad_pick(pick: str | None, expected: str) -> None:
    with pytest.raises(UserError) as exc:
        load_history(FINETUNE, pick=pick)
    assert expected in _one_line(exc)


@pytest.mark.parametrize(("line", "expected"), [
    ("[1, 2]", "line 2 is a list (fine-tune JSONL expects"),
    ('{"prompt": "a", "completion": "b"}', 'line 2 has no "messages"'),
    ('{"messages": [{"role": "user"}]}', "line 2 message 1 has no text"),
    ('{"messages": [', "line 2 is not valid JSON"),
])
def test_finetune_bad_line(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(FINETUNE.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(UserError) as exc:
        load_history(path, pick="all")
    assert expected in _refusal(exc)


# ---------------------------------------------------------------------------------------------------------
# Transcripts


def test_plain_transcript_continuations() -> None:
    turns = load_history(GOOD / "transcript.txt")
    assert [(t.role, t.text, t.time) for t in turns] == [
        ("Alice", "Did you water the tomatoes?", None),
        ("Bob", "Yes, all 20 of them.\nThey look great after the rain.", None),
        ("Alice", "Note to self: buy stakes.", None),
        ("Bob", "Re: stakes - the garden shop closes at 6.", None),
    ]


def test_bracketed_timestamps_and_a_colon_inside_a_message() -> None:
    turns = load_history(GOOD / "transcript_bracketed.txt")
    assert [t.role for t in turns] == ["Alice", "Bob", "Alice", "Bob"]
    assert turns[2].text == "The Park Hyatt.\nNote: confirmation KX-4471."  # timestamped: "Note:" opens no turn
    assert [t.time for t in turns] == ["2023-05-08 13:56", "2023-05-08 13:57", "2023-05-08 13:58", "2023-05-08 14:02"]


def test_whatsapp_export_skips_notices() -> None:
    turns = load_history(GOOD / "transcript_whatsapp.txt")
    assert [(t.role, t.text, t.time) for t in turns] == [
        ("Alice", "hi Bob", "2023-05-08 13:56"),  # day first: no date says otherwise, and not every time has pm
        ("Bob", "hey! Dinner at 8?\nP.S.: bring the wine", "2023-05-08 13:57"),  # U+202F before "pm"
    ]  # Carol's "<Media omitted>" is WhatsApp's placeholder, not her words


@pytest.mark.parametrize(("text", "expected"), [
    ("Chat with Bob, May 2023\nAlice: hi\nBob: hello\n", 'is not valid JSON, nor a "Name: text" transcript'),
    ("Alice: hi\n", "needs at least 2 turns"),
    ("08/05/2023, 13:55 - Messages are end-to-end encrypted.\n", 'no line opens a turn'),
])
def test_transcript_refusals(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "chat.txt"
    path.write_text(text)
    with pytest.raises(UserError) as exc:
        load_history(path, format="transcript" if "encrypted" in text else None)
    assert expected in _refusal(exc)


# ---------------------------------------------------------------------------------------------------------
# Detection and --format


@pytest.mark.parametrize(("name", "format", "pick"), [
    ("chatgpt_export.json", "chatgpt", "all"),
    ("claude_export.json", "claude", "all"),
    ("finetune.jsonl", "finetune", "all"),
    ("transcript.txt", "transcript", None),
    ("transcript_bracketed.txt", "transcript", None),
    ("transcript_whatsapp.txt", "transcript", None),
    ("openai.json", "openai", None),
    ("wrapped.json", "openai", None),
    ("messages.jsonl", "jsonl", None),
    ("locomo_small.json", "locomo", None),
    ("longmemeval.json", "longmemeval", None),
])
def test_detection_agrees_with_the_forced_format(name: str, format: str, pick: str | None) -> None:
    detected = load_history(GOOD / name, pick=pick)
    assert detected == load_history(GOOD / name, format=format, pick=pick)
    assert all(isinstance(t, Turn) for t in detected) and len(detected) >= 2


def test_forced_format_reads_what_detection_reads_otherwise(tmp_path: Path) -> None:
    """A fine-tune file of one line is one JSON document, {"messages": [...]}: detected as such, readable as
    fine-tune JSONL when forced, and refused as JSONL of messages."""
    path = tmp_path / "one.jsonl"
    path.write_text(FINETUNE.read_text().splitlines()[0] + "\n")
    detected = load_history(path)  # OpenAI messages: the system message is one of them
    assert detected[0].role == "system" and detected[1:] == load_history(path, format="finetune")
    assert load_history(path, format="finetune") == load_history(FINETUNE, pick=1)
    with pytest.raises(UserError) as exc:
        load_history(path, format="jsonl")
    assert 'line 1 has no "role"' in _refusal(exc)


@pytest.mark.parametrize("format", ["chatgpt", "claude", "locomo", "longmemeval", "transcript"])
def test_forcing_the_wrong_format_is_refused(format: str) -> None:
    with pytest.raises(UserError) as exc:
        load_history(GOOD / "openai.json", format=format)
    _refusal(exc)


def test_unknown_format_and_pick_where_there_is_one_conversation() -> None:
    with pytest.raises(UserError) as exc:
        load_history(GOOD / "openai.json", format="whatsapp")
    assert all(name in _one_line(exc) for name in FORMAT_NAMES)
    for kwargs in ({}, {"format": "openai"}):
        with pytest.raises(UserError) as exc:
            load_history(GOOD / "openai.json", pick=1, **kwargs)
        assert "pick applies to ChatGPT, Claude and Telegram exports and fine-tune JSONL" in _one_line(exc)
    with pytest.raises(UserError) as exc:
        load_history(GOOD / "transcript.txt", pick="all")
    assert "holds one conversation" in _one_line(exc)


@pytest.mark.parametrize("path", sorted((DATA / "bad").iterdir()), ids=lambda p: p.name)
def test_every_refusal_of_a_bad_file_names_the_formats(path: Path) -> None:
    with pytest.raises(UserError) as exc:
        load_history(path)
    _refusal(exc)


@pytest.mark.parametrize(("name", "pick"), [
    ("chatgpt_conversations.json", "all"), ("claude_conversations.json", "all"), ("finetune.jsonl", "all"),
    ("transcript.txt", None), ("whatsapp.txt", None), ("telegram_result.json", None),
    ("slack_export/cabin-trip", None), ("discord_channel.json", None), ("chat_log.md", None)])
def test_examples_load(name: str, pick: str | None) -> None:
    assert len(load_history(EXAMPLE_FILES / name, pick=pick)) >= 2


# ---------------------------------------------------------------------------------------------------------
# Property: export-shaped junk in, turns or a UserError out


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
_junk = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(st.text(max_size=5), kids, max_size=3), max_leaves=8)
_ids = st.sampled_from(["a", "b", "c", "d"])
_chatgpt_message = st.fixed_dictionaries({}, optional={
    "author": st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "assistant", "tool"]) | _junk}),
    "content": st.fixed_dictionaries({}, optional={
        "content_type": st.sampled_from(["text", "multimodal_text", "code"]) | _junk,
        "parts": st.lists(st.text(max_size=5) | _junk, max_size=3) | _junk}),
    "create_time": st.floats() | st.integers() | _junk,
    "metadata": _junk, "recipient": st.just("all") | _junk}) | _junk
_chatgpt = st.fixed_dictionaries({"mapping": st.dictionaries(_ids, st.fixed_dictionaries({}, optional={
    "message": _chatgpt_message, "parent": _ids | _junk, "children": st.lists(_ids, max_size=2) | _junk}) | _junk,
    max_size=4) | _junk}, optional={"current_node": _ids | _junk, "title": st.text(max_size=5) | _junk,
                                    "create_time": st.floats() | _junk})
_claude = st.fixed_dictionaries({"chat_messages": st.lists(st.fixed_dictionaries({}, optional={
    "sender": st.sampled_from(["human", "assistant"]) | _junk, "text": st.text(max_size=5) | _junk,
    "content": st.lists(st.fixed_dictionaries({}, optional={"type": st.just("text") | _junk,
                                                            "text": st.text(max_size=5) | _junk}) | _junk,
                        max_size=2) | _junk,
    "created_at": st.sampled_from(["2024-03-10T18:30:05Z", "nope"]) | _junk}) | _junk, max_size=3) | _junk},
    optional={"name": st.text(max_size=5) | _junk, "created_at": st.just("2024-01-01") | _junk})


@settings(max_examples=300, deadline=None)
@given(st.lists(_chatgpt, max_size=3) | _chatgpt | st.lists(_claude, max_size=3) | _claude,
       st.none() | st.sampled_from(["all", 1, 2, "x"]))
def test_exports_never_raise_anything_but_user_error(data: object, pick: object) -> None:
    try:
        turns = parse_history(data, "prop.json", pick=pick)  # type: ignore[arg-type]
    except UserError as exc:
        assert str(exc).startswith("prop.json: ") and "\n" not in str(exc)
        return
    assert len(turns) >= 2 and all(t.text and t.text == t.text.strip() and t.role for t in turns)
    assert len(format_turns(turns)) == len(turns)


_line = st.sampled_from(["Alice: hi", "Bob:", "[2023-05-08 13:56] Ann: x", "08/05/2023, 13:56 - B: y",
                         "08/05/2023, 13:56 - notice", "  ", "plain", "a: b: c", "[x] y: z", "\u2028"])


@settings(max_examples=200, deadline=None)
@given(st.lists(_line | st.text(max_size=12), max_size=6))
def test_transcripts_never_raise_anything_but_user_error(tmp_path_factory: pytest.TempPathFactory,
                                                        lines: list[str]) -> None:
    path = tmp_path_factory.mktemp("t") / "chat.txt"
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    try:
        turns = load_history(path, format="transcript")
    except UserError as exc:
        assert "chat.txt" in str(exc) and "\n" not in str(exc)
        return
    assert len(turns) >= 2 and all(t.text and t.role == t.role.strip() and t.role for t in turns)


def _locomo_sample(sample_id: str, speaker: str, text: str) -> dict:
    conversation = {"speaker_a": speaker, "speaker_b": "Ana", "session_1_date_time": "1:56 pm on 8 May, 2023",
                    "session_1": [{"speaker": speaker, "dia_id": "D1:1", "text": text},
                                  {"speaker": "Ana", "dia_id": "D1:2", "text": "Noted."}]}
    return {"sample_id": sample_id, "conversation": conversation, "qa": []}


def test_the_official_multi_conversation_locomo_file_is_picked_from(tmp_path):
    """locomo10.json holds ten samples: one is chosen by number or sample_id, or all of them."""
    path = tmp_path / "locomo10.json"
    path.write_text(json.dumps([_locomo_sample("conv-1", "Tom", "I planted 12 tomatoes."),
                                _locomo_sample("conv-2", "Joe", "I sold my bike.")]))
    with pytest.raises(UserError) as refused:
        load_history(path)
    assert "holds 2 LoCoMo conversations" in str(refused.value) and '"conv-1"' in str(refused.value)
    assert [t.text for t in load_history(path, pick=2)] == ["I sold my bike.", "Noted."]
    assert [t.role for t in load_history(path, pick="CONV-1")] == ["Tom", "Ana"]
    both = load_history(path, pick="all")
    assert [t.conversation_title for t in both] == ["conv-1", "conv-1", "conv-2", "conv-2"]
    assert load_history(path, pick=1)[0].conversation_title is None  # one conversation reads as a single file
