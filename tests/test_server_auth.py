"""The API key and redirects against a live server (issue 18): duplicate Authorization headers,
OpenAI's 401 type, the key from a file or the environment, an empty key refused before the
model loads, a warning on a public address without a key, no redirect built from Host."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import LiveServer
from test_server_hardening import AUTH, COMP, KEY, guarded_server, new_checkpoint, post, server_log

from specserve.cli import main as cli_main
from specserve.server.guard import resolve_api_key


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    server = guarded_server(new_checkpoint(tmp_path_factory))
    yield server
    server.stop()


# -- items 10, 11: the key, redirects ---------------------------------------------------------


@pytest.mark.parametrize("order", [("sk-wrong", KEY), (KEY, "sk-wrong"), (KEY, KEY)])
def test_duplicate_authorization_headers_refused(live: LiveServer, order: tuple) -> None:
    headers = [("authorization", f"Bearer {k}") for k in order]
    headers.append(("content-type", "application/json"))
    reply = httpx.post(
        live.url + COMP,
        content=json.dumps({"prompt": "hi", "max_tokens": 1}),
        headers=headers,
        timeout=30,
    )
    assert reply.status_code == 401, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"


def test_wrong_key_error_is_openais(live: LiveServer) -> None:
    reply = post(live, COMP, {"prompt": "hi"}, {"authorization": "Bearer nope"})
    error = reply.json()["error"]
    assert reply.status_code == 401
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")


def test_trailing_slash_is_no_redirect_to_the_host(live: LiveServer) -> None:
    reply = httpx.get(
        live.url + "/v1/models/",
        timeout=30,
        follow_redirects=False,
        headers={**AUTH, "host": "evil.example"},
    )
    assert reply.status_code == 404 and "location" not in reply.headers
    assert reply.json()["error"]["code"] == "not_found"


def test_api_key_sources(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    assert resolve_api_key(None, str(key_file), {}) == "sk-from-file"
    assert resolve_api_key(None, None, {"SPECSERVE_API_KEY": "sk-env"}) == "sk-env"
    assert resolve_api_key("sk-arg", None, {}) == "sk-arg"
    assert resolve_api_key(None, None, {}) is None
    for args, env, match in [
        (("", None), {}, "empty"),
        ((None, None), {"SPECSERVE_API_KEY": " "}, "empty"),
        (("a", str(key_file)), {}, "exactly one"),
        ((None, str(tmp_path / "missing")), {}, "cannot read"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_api_key(*args, env)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key(None, str(empty), {})


def test_serve_refuses_an_empty_key_before_loading(capsys: pytest.CaptureFixture) -> None:
    code = cli_main(["serve", "--api-key", "", "--model", "/nonexistent/model"])
    err = capsys.readouterr().err
    assert code == 2 and "--api-key is empty" in err and "nonexistent" not in err


def test_serve_warns_on_a_public_address_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from specserve.server.guard import check_serve_limits

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    ok = {"timeout-header": 10.0, "timeout-body": 30.0}
    with server_log() as lines:
        check_serve_limits("0.0.0.0", None, ok, 1024, 1)
        assert any("without an API key" in line for line in lines)
        lines.clear()
        check_serve_limits("0.0.0.0", "k", ok, 1024, 1)
        check_serve_limits("127.0.0.1", None, ok, 1024, 1)
        assert not lines
    with pytest.raises(ValueError, match="--timeout-body"):
        check_serve_limits("127.0.0.1", None, {"timeout-body": -1.0}, 1024, 1)
    with pytest.raises(ValueError, match="--max-connections"):
        check_serve_limits("127.0.0.1", None, ok, -1, 1)
    code = cli_main(["serve", "--timeout-body", "-1", "--model", "/nonexistent/model"])
    assert code == 2
