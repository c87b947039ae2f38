"""The server backend's HTTP client against an in-process fake server (no vLLM): request bodies, balancing,
retries, timeouts, waiting for a server that is not up yet."""
import threading
import time

import pytest

from grpo.config.schema import ServerConfig
from grpo.rollout.base import Sampling
from grpo.rollout.server import client
from grpo.rollout.server.client import Server, ServerError, ServerPool, group_request, parse_group, prompt_logprobs
from grpo.runtime.transfer import free_port
from tests.rollout.server.fake_server import FakeServer


def test_a_group_is_one_request_of_token_ids_with_n_samples():
    body = group_request("m", [3, 4, 5], 8, Sampling(16, temperature=0.7, top_p=0.9, top_k=5), [2, 9], seed=11)
    assert body["prompt"] == [3, 4, 5] and body["n"] == 8 and body["max_tokens"] == 16
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.7, 0.9, 5, 11)
    assert body["stop_token_ids"] == [2, 9] and body["return_token_ids"] and body["logprobs"] == 0
    greedy = group_request("m", [3], 8, Sampling(4, temperature=0.7, top_k=5, greedy=True), [2], seed=None)
    assert (greedy["n"], greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (1, 0.0, -1, 1.0)
    assert "seed" not in greedy
    assert group_request("m", [3], 2, Sampling(4, top_k=0), [2], None)["top_k"] == -1
    with pytest.raises(ServerError, match="temperatures in \\[0, 2\\]"):
        group_request("m", [3], 2, Sampling(4, temperature=2.5), [2], None)


def test_choices_are_read_in_index_order_and_prompt_logprobs_by_token():
    answer = {"choices": [{"index": 1, "token_ids": [7, 8], "logprobs": {"token_logprobs": [-1.0, -2.0]}},
                          {"index": 0, "token_ids": [5], "logprobs": {"token_logprobs": [-0.5]}}]}
    assert parse_group(answer) == ([[5], [7, 8]], [[-0.5], [-1.0, -2.0]])
    with pytest.raises(ServerError, match="2 tokens but 1 log-probs"):
        parse_group({"choices": [{"index": 0, "token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]})
    rows = [None, {"4": {"logprob": -1.5}}, {"9": {"logprob": -0.25}}]
    assert prompt_logprobs({"choices": [{"prompt_logprobs": rows}]}, [3, 4, 9]) == [-1.5, -0.25]
    with pytest.raises(ServerError, match="do not cover"):
        prompt_logprobs({"choices": [{"prompt_logprobs": rows}]}, [3, 4, 5])


def test_round_robin_gives_whole_groups_in_turn_and_least_loaded_the_idlest(fakes):
    a, b = fakes(), fakes()
    pool = ServerPool([a.url, b.url])
    assert [pool.pick().url for _ in range(4)] == [a.url, b.url, a.url, b.url]
    least = ServerPool([a.url, b.url], balance="least_loaded")
    first = least.pick()
    second = least.pick()
    assert {first.url, second.url} == {a.url, b.url}  # the busy one is passed over
    least.done(second)
    assert least.pick() is second and second.in_flight == 1 and first.in_flight == 1


def test_a_dropped_connection_is_retried_then_named_in_one_line(fakes):
    flaky = fakes(drop_first=1)
    assert Server(flaky.url, retries=1, retry_wait_s=0.01).get("/v1/models")["data"][0]["id"] == "tiny:llama"
    broken = fakes(drop_first=5)
    with pytest.raises(ServerError) as e:
        Server(broken.url, retries=2, retry_wait_s=0.01).get("/v1/models")
    assert len([p for p, _ in broken.requests if p == "/v1/models"]) == 3  # one try and two retries
    msg = str(e.value)
    assert broken.url in msg and "\n" not in msg and "trainer.resume=auto" in msg


def test_a_request_past_its_timeout_fails_naming_the_server(fakes):
    slow = fakes(delay_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=slow.url.replace(".", r"\.")):
        Server(slow.url, timeout_s=0.3, retries=0).post("/v1/completions", {"prompt": [1], "n": 1})
    assert time.monotonic() - t0 < 1.4


def test_the_trainer_waits_for_a_server_that_is_not_up_yet_saying_so_once():
    port = free_port()
    late = FakeServer()
    said: list[str] = []
    pool = ServerPool([f"http://127.0.0.1:{port}"], connect_timeout_s=30, say=said.append)

    def start_later():  # the fake's own port is random: a second server on the promised port comes up late
        time.sleep(1.5)
        from http.server import ThreadingHTTPServer
        srv = ThreadingHTTPServer(("127.0.0.1", port), type(late.httpd.RequestHandlerClass.__name__, (
            late.httpd.RequestHandlerClass,), {}))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)

    started: list = []
    threading.Thread(target=start_later, daemon=True).start()
    t0 = time.monotonic()
    pool.wait_until_up(poll_s=0.2)
    assert time.monotonic() - t0 >= 1.4
    assert len(said) == 1 and "waiting for the rollout server" in said[0] and str(port) in said[0]
    started[0].shutdown()
    late.httpd.server_close()
    never = ServerPool([f"http://127.0.0.1:{free_port()}"], connect_timeout_s=0.5, say=said.append)
    with pytest.raises(ServerError, match="is not up after rollout.server.connect_timeout_s=0.5"):
        never.wait_until_up(poll_s=0.1)


def test_every_field_of_a_group_request_and_the_temperature_bound():
    body = group_request("tiny:llama", (3, 4), 2, Sampling(4, temperature=2.0, top_p=0.5, top_k=3), (2,), seed=0)
    assert body == {"model": "tiny:llama", "prompt": [3, 4], "n": 2, "max_tokens": 4, "temperature": 2.0,
                    "top_p": 0.5, "top_k": 3, "stop_token_ids": [2], "ignore_eos": False, "logprobs": 0,
                    "return_token_ids": True, "skip_special_tokens": False, "seed": 0}  # 2.0 is allowed, seed 0 sent
    greedy = group_request("m", [3], 2, Sampling(4, temperature=5.0, top_p=0.9, greedy=True), [2], None)
    assert (greedy["temperature"], greedy["top_p"]) == (0.0, 1.0)
    assert group_request("m", [3], 2, Sampling(4, top_k=1), [2], None)["top_k"] == 1  # top-1 sampling is sent


def test_a_choice_without_tokens_and_prompt_logprobs_given_as_numbers():
    assert parse_group({"choices": [{"index": 0}, {"index": 1, "token_ids": None, "logprobs": None}]}) == \
        ([[], []], [[], []])
    ids, logps = parse_group({"choices": [{"index": 0, "token_ids": [4], "logprobs": {"token_logprobs": [-1]}}]})
    assert isinstance(logps[0][0], float)
    rows = [None, {"4": -1.5}, None]  # a bare number per token; a missing row does not cover its token
    assert prompt_logprobs({"choices": [{"prompt_logprobs": rows[:2]}]}, [3, 4]) == [-1.5]
    with pytest.raises(ServerError, match="do not cover"):
        prompt_logprobs({"choices": [{"prompt_logprobs": rows}]}, [3, 4, 5])
    assert prompt_logprobs({"choices": [{}]}, [3, 4]) == []


class _Answers:
    """A server answering every request with ``code`` and ``body`` (bytes), recording the requests."""

    def __init__(self, code=200, body=b"", only=None):
        """``only``: the one path answered so; any other gets an empty 404."""
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _go(self):
                n = int(self.headers.get("Content-Length") or 0)
                seen.append((self.command, self.path, self.rfile.read(n), self.headers.get("Content-Type")))
                out = body if only in (None, self.path) else b""
                self.send_response(code if only in (None, self.path) else 404)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = _go

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_requests_are_json_an_empty_answer_is_none_and_an_error_answer_is_not_retried():
    ok = _Answers(body=b"")
    try:
        s = Server(ok.url + "/", retries=3)
        assert s.url == ok.url and s.post("/reset_prefix_cache") is None and s.get("/health") is None
        s.post("/v1/completions", {"n": 2})
        assert [(m, p, b) for m, p, b, _ in ok.seen] == [
            ("POST", "/reset_prefix_cache", b"{}"), ("GET", "/health", b""), ("POST", "/v1/completions", b'{"n": 2}')]
        assert all(t == "application/json" for *_, t in ok.seen) and s.up()
    finally:
        ok.stop()
    bad = _Answers(code=500, body=b"model   not\nloaded " + b"x" * 300)
    try:
        with pytest.raises(ServerError) as e:
            Server(bad.url, retries=3, retry_wait_s=0.01).post("/v1/completions", {})
        assert len(bad.seen) == 1  # the server is up and said no: no retry
        msg = str(e.value)
        assert msg.startswith(f"rollout server {bad.url} answered /v1/completions with HTTP 500: model not loaded x")
        assert len(msg.split("HTTP 500: ")[1]) == 200 and not Server(bad.url).up()
    finally:
        bad.stop()


def test_the_retries_of_one_request_and_a_server_that_is_down(fakes):
    flaky = fakes(drop_first=1)
    s = Server(flaky.url, retries=0, retry_wait_s=0.01)
    assert s.get("/v1/models", retries=1)["data"]  # this request's own retries win over the server's
    gone = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"^rollout server http://127\.0\.0\.1:\d+ stopped answering \(/health: "
                                          r"\[Errno 111\] Connection refused\); restart it") as e:
        Server(gone, retries=2, retry_wait_s=0.2).get("/health")
    assert time.monotonic() - t0 >= 0.4 and "\n" not in str(e.value)  # two waits between three tries
    assert not Server(gone).up()


def test_the_pool_builds_its_servers_from_its_settings_and_says_on_stderr(capsys):
    pool = ServerPool(["http://a:1/", "http://b:2"], timeout_s=7.0, retries=4, connect_timeout_s=9.0)
    assert [(s.url, s.timeout_s, s.retries, s.in_flight) for s in pool.servers] == [("http://a:1", 7.0, 4, 0),
                                                                                   ("http://b:2", 7.0, 4, 0)]
    assert (pool.balance, pool.connect_timeout_s) == ("round_robin", 9.0)
    pool.say("hello")
    assert capsys.readouterr().err == "[grpo] hello\n"
    s = pool.pick()
    pool.done(s)
    assert s.in_flight == 0 and pool.pick() is pool.servers[1]
    three = ServerPool(["http://a:1", "http://b:2", "http://c:3"])
    assert [three.pick().url for _ in range(4)] == ["http://a:1", "http://b:2", "http://c:3", "http://a:1"]
    one = ServerPool(["http://a:1"], balance="least_loaded")
    assert one.pick() is one.pick() and one.servers[0].in_flight == 2  # each group in flight counts


def test_an_error_answer_that_is_not_utf8_or_cannot_be_read_and_a_reason_that_is_long_or_empty():
    import io
    import urllib.error

    bad = _Answers(code=503, body=b"not \xff ready")
    try:
        with pytest.raises(ServerError, match="with HTTP 503: not \ufffd ready$"):  # undecodable bytes replaced
            Server(bad.url).get("/v1/models")
    finally:
        bad.stop()
    unread = urllib.error.HTTPError("http://h:1/x", 502, "Bad Gateway", {}, io.BytesIO(b"lost"))
    unread.read = lambda: (_ for _ in ()).throw(OSError("gone"))  # the body cannot be read: the code alone
    assert client._short(unread) == "HTTP 502: "
    assert client._short(urllib.error.URLError("y" * 300)) == "y" * 200
    assert client._short(ConnectionResetError()) == "ConnectionResetError"  # an empty reason: the error's kind


def test_defaults_are_the_configs_and_a_url_loses_only_its_trailing_slashes():
    cfg = ServerConfig()
    s = Server("http://h:1/X//")
    assert (s.url, s.timeout_s, s.retries, s.retry_wait_s) == ("http://h:1/X", cfg.request_timeout_s, cfg.retries, 1.0)
    pool = ServerPool(["http://h:1"])
    assert (pool.servers[0].timeout_s, pool.servers[0].retries) == (cfg.request_timeout_s, cfg.retries)
    assert (pool.balance, pool.connect_timeout_s) == (cfg.balance, cfg.connect_timeout_s)


def test_the_method_asked_is_sent_and_post_passes_its_request_settings_on(fakes):
    ok = _Answers(body=b"")
    try:
        Server(ok.url).request("PUT", "/x", {"a": 1})
        Server(ok.url).request("GET", "/y", {"a": 1})  # a body does not make it a POST
        assert [(m, p) for m, p, *_ in ok.seen] == [("PUT", "/x"), ("GET", "/y")]
    finally:
        ok.stop()
    flaky = fakes(drop_first=1)
    assert Server(flaky.url, retries=0, retry_wait_s=0.01).post("/v1/models", retries=1)["data"]


def test_the_health_probe_asks_health_and_gives_up_after_five_seconds(monkeypatch):
    health = _Answers(only="/health")
    try:
        assert Server(health.url).up() and [p for _, p, *_ in health.seen] == ["/health"]
    finally:
        health.stop()
    asked = []

    def urlopen(url, timeout=None):
        asked.append((url, timeout))
        raise TimeoutError("timed out")

    monkeypatch.setattr(client.urllib.request, "urlopen", urlopen)
    assert not Server("http://h:1").up() and asked == [("http://h:1/health", 5)]  # a hung server is not up


def test_what_the_pool_says_reaches_a_buffered_stderr_at_once(monkeypatch):
    import io

    raw = io.BytesIO()
    monkeypatch.setattr(client.sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8"))  # a pipe: block-buffered
    ServerPool(["http://h:1"]).say("waiting")
    assert raw.getvalue() == b"[grpo] waiting\n"


def test_waiting_polls_once_a_second_and_gives_a_server_until_its_deadline(monkeypatch):
    import types

    clock, slept = iter([0.0, 0.5, 3.0]), []
    monkeypatch.setattr(client, "time", types.SimpleNamespace(monotonic=lambda: next(clock), sleep=slept.append))
    pool = ServerPool(["http://a:1"], connect_timeout_s=3.0, say=lambda m: None)
    answers = iter([False, False, True])
    pool.servers[0].up = lambda: next(answers)
    pool.wait_until_up()  # down at 0.5 and at 3.0 (the deadline itself), up at the third look
    assert slept == [1.0, 1.0]
    clock = iter([10.0, 13.5])
    pool.servers[0].up = lambda: False
    with pytest.raises(ServerError, match="not up after"):
        pool.wait_until_up()  # 13.5 is past the deadline 10.0 + 3.0


def test_drop_says_how_many_are_left_ignores_a_server_already_out_and_the_last_raises():
    said = []
    pool = ServerPool(["http://a", "http://b", "http://c"], say=said.append)
    pool.drop("http://b", "rollout server http://b stopped answering; resume with ...")
    assert [s.url for s in pool.servers] == ["http://a", "http://c"]
    assert said == ["rollout server http://b stopped answering: carrying on with 2 of 3 rollout servers "
                    "(http://a, http://c)"]
    pool.drop("http://b", "again")  # already out: nothing happens, nothing is said
    assert len(pool.servers) == 2 and len(said) == 1
    pool.drop("http://a", "a went")
    with pytest.raises(client.ServerDown, match="^c went$"):
        pool.drop("http://c", "c went")
    assert [s.url for s in pool.servers] == ["http://c"] and len(said) == 2


def test_add_puts_a_rejoined_server_back_in_its_place_once():
    pool = ServerPool(["http://a", "http://b", "http://c"], say=lambda m: None)
    known = list(pool.known)
    pool.drop("http://a", "x")
    pool.drop("http://b", "y")
    pool.add("http://b")
    assert [s.url for s in pool.servers] == ["http://b", "http://c"]
    pool.add("http://a")
    pool.add("http://a")
    assert pool.servers == known  # the same Server objects, in the order given, each once


class _RecordedPosts:
    def __init__(self, answer):
        self.answer, self.asked = answer, []

    def post(self, path, body):
        self.asked.append((path, body))
        return self.answer


def test_model_info_asks_the_worker_extension_and_reads_its_first_result():
    server = _RecordedPosts({"results": [{"max_model_len": 64}, {"max_model_len": 1}]})
    assert client.model_info(server) == {"max_model_len": 64}
    assert server.asked == [("/collective_rpc", {"method": "grpo_model_info"})]
    for empty in (None, {}, {"results": []}, {"results": None}, {"results": [None]}, {"results": [{}]}):
        assert client.model_info(_RecordedPosts(empty)) == {}


def test_an_answer_is_its_json_its_text_where_it_is_not_json_and_none_when_empty():
    assert client._decoded(b"") is None
    assert client._decoded(b'{"ok": [1, 2]}') == {"ok": [1, 2]} and client._decoded(b"0") == 0
    assert client._decoded(b"Success: LoRA adapter 'v3' added") == "Success: LoRA adapter 'v3' added"
    assert client._decoded(b"loaded \xff v3") == "loaded \ufffd v3"  # not UTF-8: replaced, never an error


def test_a_key_is_sent_as_a_bearer_token_by_every_server_of_the_pool_and_a_refusal_names_it(fakes):
    guarded = fakes(api_key="s3cret")
    pool = ServerPool([guarded.url], api_key="s3cret", say=lambda msg: None)
    assert pool.servers[0].get("/v1/models")["data"][0]["id"] == "tiny:llama"  # the guarded server let it in
    with pytest.raises(ServerError, match="refused /v1/models: wrong or missing API key"):
        Server(guarded.url, retries=0).get("/v1/models")
