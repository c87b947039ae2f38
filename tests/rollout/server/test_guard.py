"""grpo/rollout/server/guard.py: grpo-serve's API key on every route of vLLM's server but /health (an ASGI app called
in the test's process; tests/rollout/server/test_launch.py checks grpo-serve puts it in front of vLLM)."""
import asyncio
import json

from grpo.rollout.server.guard import RequireKey


def _call(guard, scope):
    """What ``guard`` does with one request: "passed" on to the app (with the request's own receive and send), or the
    messages it sent."""
    sent, before = [], len(guard.reached)

    async def send(message):
        sent.append(message)

    asyncio.run(guard(scope, "receive", send))
    if len(guard.reached) > before:
        assert guard.reached[-1] == (scope, "receive", send) and sent == []
        return "passed"
    return sent


def _guard(key="k"):
    reached = []

    async def app(scope, receive, send):
        reached.append((scope, receive, send))

    g = RequireKey(app, key=key)
    g.reached = reached
    return g


def _scope(path="/update_weights", auth=None, **kw):
    headers = [(b"x-other", b"1")] + ([(b"authorization", auth)] if auth is not None else [])
    return {"type": "http", "method": "POST", "path": path, "headers": headers, **kw}


def test_the_key_passes_as_a_bearer_token_in_any_case_of_the_scheme():
    g = _guard("s3cret")
    assert _call(g, _scope(auth=b"Bearer s3cret")) == "passed" and g.reached[0][0]["path"] == "/update_weights"
    assert _call(g, _scope(auth=b"bearer s3cret")) == "passed"
    assert _call(g, _scope(auth=b"BEARER s3cret")) == "passed"
    spaced = _guard("a key with spaces")  # the token is everything after the scheme's one space
    assert _call(spaced, _scope(auth=b"Bearer a key with spaces")) == "passed"
    assert _call(spaced, _scope(auth=b"Bearer a key with")) != "passed"


def test_a_wrong_missing_or_malformed_key_is_answered_401_with_a_json_body():
    g = _guard("s3cret")
    body = json.dumps({"error": "Unauthorized: this grpo-serve server wants its API key"}).encode()
    for auth in (None, b"", b"Bearer wrong", b"Basic s3cret", b"Bearer  s3cret", b"Bearers3cret", b"s3cret",
                 b"Bearer s3cret ", b"Bearer \xff"):
        sent = _call(g, _scope(auth=auth))
        assert sent == [{"type": "http.response.start", "status": 401,
                         "headers": [(b"content-type", b"application/json"),
                                     (b"content-length", str(len(body)).encode())]},
                        {"type": "http.response.body", "body": body}], auth
    assert g.reached == []
    assert _call(g, {"type": "http", "method": "GET", "path": "/x"}) != "passed"  # no headers at all


def test_health_and_preflight_and_other_scopes_stay_open():
    g = _guard("s3cret")
    assert _call(g, _scope("/health")) == "passed"
    assert _call(g, _scope("/api/health", root_path="/api")) == "passed"  # mounted under a root path
    assert _call(g, _scope("/api/update_weights", root_path="/api")) != "passed"
    assert _call(g, _scope("/healthz")) != "passed" and _call(g, _scope("/health/x")) != "passed"
    assert _call(g, _scope(method="OPTIONS")) == "passed"  # CORS preflight carries no credentials
    assert _call(g, {"type": "lifespan"}) == "passed"
    assert _call(g, {"type": "websocket", "path": "/ws", "headers": []}) != "passed"
    assert _call(g, {"type": "websocket", "path": "/ws", "headers": [(b"authorization", b"Bearer s3cret")]}) == \
        "passed"


def test_the_key_comes_from_vllm_api_key_and_without_one_everything_passes(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    g = _guard(key=None)
    assert _call(g, _scope(auth=b"Bearer from-env")) == "passed" and _call(g, _scope(auth=b"Bearer k")) != "passed"
    assert _call(_guard(key="given"), _scope(auth=b"Bearer given")) == "passed"  # a given key wins
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert _call(_guard(key=None), _scope()) == "passed"
    monkeypatch.delenv("VLLM_API_KEY")
    g = _guard(key=None)
    assert g.digest is None and _call(g, _scope()) == "passed"
    assert _call(_guard(key=""), _scope()) == "passed"
