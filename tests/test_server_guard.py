"""Who may talk to the server: Host names (DNS rebinding), the API key's form, the schema under a key."""

import httpx
import pytest
from server_helpers import KEY, USER, scripted_server


@pytest.fixture(scope="module")
def keyed(tiny_tokenizer):
    server = scripted_server(tiny_tokenizer, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_server(tiny_tokenizer):
    server = scripted_server(tiny_tokenizer)
    yield server
    server.stop()


def chat(server, headers):
    body = {"model": "fake", "messages": USER, "max_tokens": 2}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8000", "192.168.1.5", "127.0.0.1.evil.example"]
)
def test_loopback_server_refuses_foreign_host_names(open_server, host):
    for path in ("/v1/models", "/health", "/openapi.json"):
        r = httpx.get(open_server.url + path, headers={"Host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (path, r.text)
    assert chat(open_server, {"Host": host}).status_code == 403


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1", "127.0.0.2:80", "[::1]:8000"])
def test_loopback_names_are_served(open_server, host):
    assert httpx.get(open_server.url + "/health", headers={"Host": host}).status_code == 200
    assert chat(open_server, {"Host": host}).status_code == 200


def test_allowed_hosts_rules():
    from expertstream.server.app import allowed_hosts
    from expertstream.server.guard import host_allowed, host_name

    assert host_name("[::1]:8000") == "::1" and host_name("Example.COM:80") == "example.com"
    assert host_allowed("api.example.com", [".example.com"]) and host_allowed("example.com", [".example.com"])
    assert not host_allowed("badexample.com", [".example.com"])
    assert host_allowed("anything", ["*"]) and not host_allowed("localhost", ["example.com"])
    # the CLI: loopback names on a loopback bind, anything on 0.0.0.0, the flag over both
    assert allowed_hosts("127.0.0.1", None) is None and allowed_hosts("::1", None) is None
    assert allowed_hosts("0.0.0.0", None) == ["*"]
    assert allowed_hosts("127.0.0.1", ["box.lan"]) == ["box.lan"]


def test_api_key_needs_the_bearer_scheme(keyed):
    for headers in ({"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}):
        r = chat(keyed, headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    assert chat(keyed, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert chat(keyed, {"Authorization": f"bearer {KEY}"}).status_code == 200
    assert chat(keyed, {"x-api-key": KEY}).status_code == 200  # the Anthropic clients' header


def test_schema_and_docs_need_the_key(keyed, open_server):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(keyed.url + path).status_code == 401, path
        assert httpx.get(keyed.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(open_server.url + path).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200
