"""Bad requests, table-driven: each gets its documented status and the OpenAI error envelope,
and afterwards the server still serves with every KV page free again.

The server runs with an API key, so every request below carries it unless the case is about
the key. Documented choices: a wrong Content-Type is a 400; an explicit max_tokens that does not
fit beside the prompt is a 400 (an omitted or null one is clamped to the room left).
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from test_server import LiveServer, tiny_config
from tiny_models import make_tiny_checkpoint

KEY = "sk-test-key"
MAX_BODY = 2 << 20
VOCAB = 512  # make_tiny_checkpoint's default
MAX_LEN = 256  # the tiny model's max_position_embeddings
COMP, CHAT = "/v1/completions", "/v1/chat/completions"


def comp(**fields: object) -> dict:
    return {"prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields: object) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def raw(text: str) -> bytes:
    return text.encode()


# (name, path, body: dict | list | bytes | None, status, param, extra headers)
CASES = [
    ("max_tokens=0", COMP, comp(max_tokens=0), 400, "max_tokens", {}),
    ("max_tokens=-1", COMP, comp(max_tokens=-1), 400, "max_tokens", {}),
    ("max_tokens=1.5", COMP, comp(max_tokens=1.5), 400, "max_tokens", {}),
    ("max_tokens='10'", COMP, comp(max_tokens="10"), 400, "max_tokens", {}),
    ("max_tokens=2**63", COMP, comp(max_tokens=2**63), 400, "max_tokens", {}),
    ("max_tokens over the context", COMP, comp(max_tokens=MAX_LEN), 400, "max_tokens", {}),
    ("chat max_tokens=0", CHAT, chat(max_tokens=0), 400, "max_tokens", {}),
    ("temperature=-1", COMP, comp(temperature=-1), 400, "temperature", {}),
    ("temperature=NaN", COMP, raw('{"prompt": "x", "temperature": NaN}'), 400, None, {}),
    ("temperature=1e309", COMP, raw('{"prompt": "x", "temperature": 1e309}'), 400,
     "temperature", {}),
    ("temperature=true", COMP, comp(temperature=True), 400, "temperature", {}),
    ("top_p=0", COMP, comp(top_p=0), 400, "top_p", {}),
    ("top_p=-0.1", COMP, comp(top_p=-0.1), 400, "top_p", {}),
    ("top_p=1.0001", COMP, comp(top_p=1.0001), 400, "top_p", {}),
    ("top_k=-2", COMP, comp(top_k=-2), 400, "top_k", {}),
    ("top_k=2**31", COMP, comp(top_k=2**31), 400, "top_k", {}),
    ("min_p=2", COMP, comp(min_p=2), 400, "min_p", {}),
    ("seed=-1", COMP, comp(seed=-1), 400, "seed", {}),
    ("seed=2**64", COMP, comp(seed=2**64), 400, "seed", {}),
    ("seed='x'", COMP, comp(seed="x"), 400, "seed", {}),
    ("n=0", COMP, comp(n=0), 400, "n", {}),
    ("n=17 (past MAX_N)", CHAT, chat(n=17), 400, "n", {}),
    ("n=10**6", COMP, comp(n=10**6), 400, "n", {}),
    ("logprobs=21 (past --max-logprobs)", COMP, comp(logprobs=21), 400, "logprobs", {}),
    ("logprobs=-1", COMP, comp(logprobs=-1), 400, "logprobs", {}),
    ("chat top_logprobs without logprobs", CHAT, chat(top_logprobs=3), 400, "top_logprobs",
     {}),
    ("chat top_logprobs=21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     {}),
    ("echo + logprobs past the cap", COMP, comp(echo=True, logprobs=21), 400, "logprobs", {}),
    ("best_of=3", COMP, comp(best_of=3), 400, "best_of", {}),
    ("suffix", COMP, comp(suffix="x"), 400, "suffix", {}),
    ("presence_penalty=3", COMP, comp(presence_penalty=3), 400, "presence_penalty", {}),
    ("frequency_penalty=-2.5", CHAT, chat(frequency_penalty=-2.5), 400, "frequency_penalty",
     {}),
    ("repetition_penalty=0", COMP, comp(repetition_penalty=0), 400, "repetition_penalty", {}),
    ("min_tokens=-1", COMP, comp(min_tokens=-1), 400, "min_tokens", {}),
    ("min_tokens > max_tokens", COMP, comp(min_tokens=9, max_tokens=4), 400, "min_tokens", {}),
    ("logit_bias id past vocab", COMP, comp(logit_bias={str(VOCAB): 1}), 400, "logit_bias", {}),
    ("logit_bias key not an id", COMP, comp(logit_bias={"a": 1}), 400, "logit_bias", {}),
    ("logit_bias=101", COMP, comp(logit_bias={"5": 101}), 400, "logit_bias", {}),
    ("tool_choice", CHAT, chat(tool_choice="auto"), 400, "tool_choice", {}),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", {}),
    ("response_format json", CHAT, chat(response_format={"type": "json_object"}), 400,
     "response_format", {}),
    ("vLLM extra prompt_logprobs", COMP, comp(prompt_logprobs=1), 400, "prompt_logprobs", {}),
    ("vLLM extra guided_json", CHAT, chat(guided_json={"type": "object"}), 400, "guided_json",
     {}),
    ("tokenize: neither prompt nor messages", "/tokenize", {}, 400, "prompt", {}),
    ("detokenize: id past vocab", "/detokenize", {"tokens": [VOCAB]}, 400, "tokens", {}),
    ("detokenize: not ids", "/detokenize", {"tokens": ["a"]}, 400, "tokens[0]", {}),
    ("stop=''", COMP, comp(stop=""), 400, "stop", {}),
    ("stop=['']", COMP, comp(stop=[""]), 400, "stop", {}),
    ("10,000 stop strings", COMP, comp(stop=[f"s{i}" for i in range(10_000)]), 400, "stop", {}),
    ("1 MB stop string", COMP, comp(stop=["x" * (1 << 20)]), 400, "stop", {}),
    ("stop_token_ids=[vocab]", COMP, comp(stop_token_ids=[VOCAB]), 400, "stop_token_ids", {}),
    ("stop_token_ids=[-1]", COMP, comp(stop_token_ids=[-1]), 400, "stop_token_ids", {}),
    ("unknown model", COMP, comp(model="gpt-17"), 404, "model", {}),
    ("empty body", COMP, b"", 400, None, {}),
    ("truncated JSON", COMP, raw('{"prompt": "hel'), 400, None, {}),
    ("top-level array", COMP, [comp()], 400, None, {}),
    ("top-level string", COMP, raw('"hello"'), 400, None, {}),
    ("wrong Content-Type", COMP, json.dumps(comp()).encode(), 400, None,
     {"content-type": "text/plain"}),
    ("invalid UTF-8", COMP, b'{"prompt": "\xff\xfe"}', 400, None, {}),
    ("lone surrogate", COMP, raw('{"prompt": "a\\ud800b"}'), 400, None, {}),
    ("deep nesting", COMP, raw('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"), 400,
     None, {}),
    ("missing prompt", COMP, {"max_tokens": 4}, 400, "prompt", {}),
    ("prompt=42", COMP, comp(prompt=42), 400, "prompt", {}),
    ("empty prompt", COMP, comp(prompt=""), 400, "prompt", {}),
    ("batch of prompts", COMP, comp(prompt=["a", "b"]), 400, "prompt", {}),
    ("token ids []", COMP, comp(prompt=[]), 400, "prompt", {}),
    ("token ids [-1]", COMP, comp(prompt=[-1]), 400, "prompt", {}),
    ("token ids [vocab]", COMP, comp(prompt=[VOCAB]), 400, "prompt", {}),
    ("token ids mixed", COMP, comp(prompt=[1, "a", 2.5]), 400, "prompt", {}),
    ("prompt over the context", COMP, comp(prompt=[5] * MAX_LEN), 400, "prompt", {}),
    ("messages=[]", CHAT, chat(messages=[]), 400, "messages", {}),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role", {}),
    ("null content", CHAT, chat(messages=[{"role": "user", "content": None}]), 400,
     "messages[0].content", {}),
    ("image content part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
     "messages[0].content[0].type", {}),
    ("template rejects role", CHAT, chat(messages=[{"role": "system", "content": "x"}]), 400,
     "messages", {}),
    ("tools", CHAT, chat(tools=[{"type": "function"}]), 400, "tools", {}),
    ("stream_options without stream", COMP, comp(stream_options={"include_usage": True}), 400,
     "stream_options", {}),
    ("unknown stream_options key", COMP, comp(stream=True, stream_options={"every": True}),
     400, "stream_options.every", {}),
    ("stream + bad value: no 200 first", COMP, comp(stream=True, top_p=7), 400, "top_p", {}),
    ("body over the cap", COMP, comp(prompt="x" * (MAX_BODY + 10)), 413, None, {}),
    ("missing key", COMP, comp(), 401, None, {"authorization": None}),
    ("wrong key", COMP, comp(), 401, None, {"authorization": "Bearer sk-wrong"}),
    ("malformed Authorization", COMP, comp(), 401, None, {"authorization": f"Basic {KEY}"}),
    ("missing key on /v1/models", "GET /v1/models", None, 401, None, {"authorization": None}),
    ("missing key on /metrics", "GET /metrics", None, 401, None, {"authorization": None}),
    ("unknown route", "/v1/nope", comp(), 404, None, {}),
    ("GET on a POST route", "GET " + COMP, None, 405, None, {}),
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", tokenizer=True)
    server = LiveServer(tiny_config(path), api_key=KEY, max_body_bytes=MAX_BODY)
    yield server
    server.stop()


def send(live: LiveServer, path: str, body: object, headers: dict[str, str | None],
         ) -> httpx.Response:
    method, _, path = path.rpartition(" ")
    sent = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    sent.update(headers)
    sent = {k: v for k, v in sent.items() if v is not None}
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return httpx.request(method or "POST", live.url + path, content=content, headers=sent,
                         timeout=60)


def test_table_is_big_enough() -> None:
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,path,body,status,param,headers", CASES, ids=[c[0] for c in CASES])
def test_bad_request(live: LiveServer, name: str, path: str, body: object, status: int,
                     param: str | None, headers: dict) -> None:
    reply = send(live, path, body, headers)
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    if param is not None:
        assert error["param"] == param, error


def test_body_cap_counts_streamed_bytes(live: LiveServer) -> None:
    """A chunked body (no Content-Length) is still cut off at the cap."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    reply = httpx.post(live.url + COMP, content=chunks(), timeout=60,
                       headers={"authorization": f"Bearer {KEY}",
                                "content-type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


def test_declared_length_over_the_cap_refused_before_reading(live: LiveServer) -> None:
    """A Content-Length over the cap is answered 413 before the body is sent at all."""
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {50 << 20}\r\n\r\n"
                     .encode())
        reply = b""
        while b"request_too_large" not in reply and (chunk := sock.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply


@pytest.mark.parametrize("body", [comp(max_tokens=None), {"prompt": "hi"}, comp(top_p=1.0),
                                  chat(max_tokens=None), comp(stop=["\n"], top_k=0)])
def test_edge_values_accepted(live: LiveServer, body: dict) -> None:
    path = CHAT if "messages" in body else COMP
    reply = send(live, path, body, {})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_health_needs_no_key(live: LiveServer) -> None:
    assert httpx.get(live.url + "/health").status_code == 200


def test_still_serves_and_no_kv_leak(live: LiveServer) -> None:
    """Runs after the table (pytest keeps file order)."""
    reply = send(live, COMP, comp(max_tokens=3, temperature=0), {})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    stats = live.wait_idle()
    assert stats["kv_free_pages"] == live.initial_free_pages
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert httpx.get(live.url + "/health").status_code == 200


@pytest.mark.parametrize("kind,says", [("image_url", "served text-only"),
                                       ("input_audio", "served text-only"),
                                       ("refusal", "only text parts are")])
def test_non_text_content_parts_say_why(kind: str, says: str) -> None:
    """An image (e.g. to a Kimi K2.5 checkpoint, served as its language model) is refused with
    the reason, naming the part."""
    from specserve.server.errors import APIError
    from specserve.server.protocol import ChatMessage

    msg = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "look:"}, {"type": kind}]})
    with pytest.raises(APIError) as err:
        msg.text(2)
    assert says in err.value.message and err.value.param == "messages[2].content[1].type"


def test_unknown_fields_are_logged_once_by_name(caplog) -> None:
    """An extra field no request shape defines (metadata, store, ...) is ignored and the log
    names it, once per name."""
    import uuid

    from specserve.server import parsing, protocol

    name = f"x_{uuid.uuid4().hex[:8]}"  # never seen before in this process
    body = json.dumps({"model": "m", "prompt": "x", name: 1}).encode()
    with caplog.at_level("WARNING", logger="specserve.server.parsing"):
        protocol.parse_request(body, "application/json", protocol.CompletionRequest)
        protocol.parse_request(body, "application/json", protocol.CompletionRequest)
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1 and "not used by this server" in lines[0]
    assert "prompt" not in parsing._WARNED_FIELDS
