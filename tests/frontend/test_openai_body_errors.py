"""Bodies the OpenAI front cannot read, through the real app (FastAPI's own parsing; no Triton behind it: every
case is refused before a request would be sent): each gets one OpenAI error saying what is wrong."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from backend_lib.frontend.openai.app import FrontSettings, create_app

GOOD = '{"model": "deepinfer", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(FrontSettings(grpc_url="localhost:1"))) as client:
        yield client


@pytest.mark.parametrize("body, content_type, status, message, param", [
    ('{"model": "deepinfer", "messages": [}', "application/json", 400,
     "the request body is not valid JSON: Expecting value at character 36", None),
    (GOOD, "application/x-www-form-urlencoded", 415,
     "the request body must be JSON: send it with Content-Type: application/json "
     "(got application/x-www-form-urlencoded)", None),
    (GOOD, None, 415, "the request body must be JSON: send it with Content-Type: application/json "
                      "(got no Content-Type)", None),
    ("", "application/json", 400, "the request body is empty: send a JSON object", None),
    ("[1]", "application/json; charset=utf-8", 400, "the request body must be a JSON object, got an array", None),
    ('{"model": 3, "messages": []}', "application/json", 400, "model: Input should be a valid string", "model"),
], ids=["malformed", "form", "no-content-type", "empty", "array", "field"])
def test_a_body_the_front_cannot_read_is_refused_saying_why(client, body, content_type, status, message, param):
    headers = {"Content-Type": content_type} if content_type else {}
    answer = client.post("/v1/chat/completions", content=body, headers=headers)
    error = answer.json()["error"]
    assert (answer.status_code, error["message"], error["param"]) == (status, message, param)
    assert error["code"] == ("unsupported_media_type" if status == 415 else None)
