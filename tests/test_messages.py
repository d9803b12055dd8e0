"""Messages name settings, options and commands by neutral references (kvchat.messages), which each front end
spells: the CLI as flags and command lines, the server as request fields and endpoints, `str()` plainly."""

from __future__ import annotations

import shlex

from hypothesis import given
from hypothesis import strategies as st

from kvchat.cli.words import error_text
from kvchat.cli.words import spell as cli
from kvchat.errors import UserError, first_line, message
from kvchat.messages import command, option, plain, referenced, setting
from kvchat.serve.spelling import spell as http


def test_a_setting_is_its_option_or_setting_flag_at_the_terminal_its_field_over_http_and_its_key_plainly():
    text = f"{setting('budget', 64)} is less than 80; raise {setting('budget')} or lower {setting('block_size', 32)}"
    assert cli(text) == "--budget 64 is less than 80; raise --budget or lower --setting block_size=32"
    assert http(text) == '"budget": 64 is less than 80; raise "budget" or lower block_size=32'
    assert plain(text) == "budget=64 is less than 80; raise budget or lower block_size=32"


def test_values_keep_their_type_and_strings_their_characters():
    assert cli(setting("method", "recall")) == "--method recall"
    assert http(setting("method", "recall")) == '"method": "recall"'
    assert cli(setting("recall_share", 0.5)) == "--setting recall_share=0.5"
    assert cli(setting("alpha", None)) == "--setting alpha=null"
    assert plain(setting("system_prompt", "a b} {c")) == 'system_prompt="a b} {c"'
    assert cli(setting("system_prompt", "a b} {c")) == "--setting system_prompt=a b} {c"


def test_an_option_is_its_flag_at_the_terminal_and_its_request_field_when_a_request_has_one():
    assert cli(option("episode", 3)) == "--episode 3"
    assert http(option("episode", 3)) == '"episode": 3'
    assert cli(option("max_new_tokens")) == "--max-new-tokens"
    assert http(option("max_new_tokens")) == '"max_tokens"'
    assert cli(option("replace")) == cli(option("replace", True)) == "--replace"
    assert http(option("device", "cpu")) == plain(option("device", "cpu")) == "device=cpu"


def test_a_command_is_a_command_line_at_the_terminal_and_its_endpoint_over_http():
    assert cli(f"see `{command('list')}`") == "see `kvchat list`"
    assert http(f"see `{command('list')}`") == "see `GET /kvchat/conversations`"
    assert plain(f"see `{command('list')}`") == "see `list`"
    rebuild = command("ingest", "my history.json", name="chat", budget=64, block_size=32, replace=True)
    assert shlex.split(cli(rebuild)) == ["kvchat", "ingest", "my history.json", "--name", "chat", "--budget", "64",
                                         "--setting", "block_size=32", "--replace"]
    # block_size is no request field: the server says what it would take plainly, never a flag
    assert http(rebuild) == 'ingest "my history.json" name=chat budget=64 block_size=32 replace=true'
    assert http(command("ingest", "HISTORY", name="chat", replace=True)) == (
        'POST /kvchat/ingest {"name": "chat", "replace": true}')
    assert http(command("rm", "chat")) == "DELETE /kvchat/conversations/chat"
    assert cli(command("doctor", fix=True)) == "kvchat doctor --fix"
    assert http(command("doctor", fix=True)) == "doctor fix=true"


def test_an_error_reads_plainly_and_keeps_its_references_for_front_ends_and_wrappers():
    error = UserError(f"{setting('budget', 8)} is too small (see `{command('list')}`)")
    assert str(error) == "budget=8 is too small (see `list`)"
    assert error_text(error) == "--budget 8 is too small (see `kvchat list`)"
    wrapped = UserError(f"cannot ingest: {first_line(error)}")
    assert error_text(wrapped) == "cannot ingest: --budget 8 is too small (see `kvchat list`)"
    assert message(ValueError("--x")) == "--x"


def test_text_that_only_looks_like_a_reference_stays_as_it_is():
    for text in ("{setting:budget=}", "{setting:budget=64", "{command:ingest=5}", "{option:Episode}",
                 '{"setting": 1}', "{setting:budget=[1,2]"):
        assert cli(text) == plain(text) == http(text) == text
    assert referenced("{setting:budget=}") == []


@given(st.text(alphabet=st.sampled_from(list("{}:=\"[]ab,1 settingoptcommand")), max_size=40))
def test_any_text_spells_without_failing(text):
    spelled = cli(text)
    if "{" not in text:
        assert spelled == text


def test_referenced_lists_what_a_message_names():
    text = f"{setting('budget')} {option('episode', 1)} {command('ingest', 'H', name='x', method='recall')}"
    assert referenced(text) == [("setting", "budget"), ("option", "episode"), ("command", "ingest"),
                                ("option", "name"), ("option", "method")]


def test_every_request_field_the_server_names_is_one_a_request_takes():
    import pytest

    pytest.importorskip("fastapi")
    from kvchat.serve.app import AskBody, IngestBody
    from kvchat.serve.protocol import ChatCompletionRequest
    from kvchat.serve.spelling import FIELDS

    fields = {*AskBody.model_fields, *IngestBody.model_fields, *ChatCompletionRequest.model_fields}
    assert set(FIELDS.values()) - fields == set()
