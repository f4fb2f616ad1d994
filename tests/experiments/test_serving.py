"""experiments.serving and its vLLM client and server (experiments/_vllm_client.py, _vllm_server.py): metrics parsing, Poisson schedule, the load driver
against a local stand-in server, prompt construction; one `serving` test runs the real vLLM."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from experiments import _vllm_client as client
from experiments import _vllm_server as server
from experiments import serving as exp

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
    """Streams 3 chunks; a prompt containing SLOW waits `slow` seconds before the first one."""

    slow = 5.0

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = METRICS.encode() if self.path == "/metrics" else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["stream"] and req["stream_options"] == {"include_usage": True}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            if "SLOW" in req["prompt"]:
                time.sleep(self.slow)
            for t in (" grant", "_access", "\n"):
                self.wfile.write(b"data: " + json.dumps({"choices": [{"text": t}]}).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(0.01)
            usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
            self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        except OSError:
            pass


@pytest.fixture
def fake_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    httpd.daemon_threads = True
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_streaming_request_times_the_first_chunk_and_reads_usage(fake_server):
    r = client.StreamingRequest(fake_server, {"model": "m", "prompt": "hi", "max_tokens": 3}).run()
    assert r.status == "ok", r.error
    assert r.text == " grant_access\n" and (r.prompt_tokens, r.completion_tokens) == (7, 3)
    assert 0 < r.ttft_s < r.latency_s < 5
    assert client.counters(fake_server).queries == 8210.0


def test_run_load_sends_on_schedule_and_cancels_at_the_cap(fake_server):
    arrivals = [0.0, 0.2, 0.4, 5.0]  # the last one falls after the cap: never sent
    prompts = ["a", "SLOW", "b", "c"]
    t0 = time.monotonic()
    sent, wall = client.run_load(
        lambda i: client.StreamingRequest(fake_server, {"model": "m", "prompt": prompts[i]}),
        arrivals, max_seconds=1.0)
    assert time.monotonic() - t0 < 4.0 and wall < 4.0  # the slow one was cut, not waited for
    assert [s.index for s in sent] == [0, 1, 2]
    ok, slow, late = (s.result for s in sent)
    assert ok.status == late.status == "ok" and slow.status == "cancelled"
    assert math.isnan(slow.ttft_s) and sent[1].cutoff_s == pytest.approx(1.0, abs=0.5)
    assert sent[2].arrival_s == 0.4 and math.isnan(sent[0].cutoff_s)


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


def test_decision_of_reads_the_first_word():
    outs = ("grant_access", "escalate")
    assert exp.decision_of(" escalate\n\n[", outs) == "escalate"
    assert exp.decision_of(" grant_acc", outs) == "grant_access"  # cut by max_tokens
    assert exp.decision_of("**grant_access**", outs) == "grant_access"
    assert exp.decision_of(" request_production_", outs) == "request_production_"
    assert exp.decision_of("", outs) == ""
    assert exp.request_id(1, 7) == "RQ-010007"


def test_summary_ratios_and_censoring():
    def row(variant, i, ttft, status="ok", decision="escalate", rate=1.0):
        lower = ttft if status == "ok" else 30.0
        return {"phase": "poisson", "rate": rate, "variant": variant, "index": i, "value": "new",
                "status": status, "ttft_lower_s": lower, "latency_s": ttft + 0.1,
                "end_s": i + ttft + 0.1, "decision": decision, "correct": decision == "escalate",
                "prompt_tokens": 100.0, "wall_s": 40.0, "phase_hit_rate": 0.99 if variant == "erratum" else 0.01,
                "phase_server_ttft_mean_s": 1.0, "phase_server_ttft_p90_s": 1.0, "item_id": "x",
                "startup_s": 12.0}

    recs = [row("edit", i, 10.0 * (i + 1)) for i in range(3)] + [row("edit", 3, math.nan, "cancelled")]
    recs += [row("erratum", i, 0.5, decision="grant_access" if i == 0 else "escalate") for i in range(4)]
    cfg = exp.ServingConfig(length=1000, max_model_len=2048)
    s = exp.summarize(recs, cfg)
    e, r = s["results"]["edit"]["1"], s["results"]["erratum"]["1"]
    assert e["n_censored"] == 1 and e["ttft_is_lower_bound"] and not r["ttft_is_lower_bound"]
    assert e["ttft_p50_s"] == pytest.approx(25.0)  # 10, 20, 30, >=30 (censored at its lower bound)
    assert r["decision_agreement"] == pytest.approx(2 / 3)  # pairs only where both completed
    assert s["p90_ratio"]["1"] == pytest.approx(e["ttft_p90_s"] / 0.5)
    assert e["throughput"] == pytest.approx(3 / 40.0) and s["startup_s"] == 12.0
    assert any(line.startswith("| erratum | 1 |") for line in s["table"])


def test_config_refuses_bad_values():
    with pytest.raises(ValueError):
        exp.ServingConfig(variants=["erratum"])  # nothing to compare with
    with pytest.raises(ValueError):
        exp.ServingConfig(length=8100, max_model_len=8192)
    with pytest.raises(ValueError):
        exp.ServingConfig(rates=[0.0])


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
                 "experiment.length=1024", "experiment.max_model_len=2048",
                 "experiment.n_sequential=2", "experiment.rates=[2.0]", "experiment.n_poisson=4",
                 "experiment.max_phase_s=60", "experiment.kv_cache_gib=1",
                 "experiment.variants=[edit,erratum]"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        run_dir = runner.run(compose("config", overrides=overrides))
    s = json.loads((run_dir / "summary.json").read_text())
    log = (run_dir / "server.log").read_text()
    assert "--host 127.0.0.1" in log
    for label in ("sequential", "2"):
        e, r = s["results"]["edit"][label], s["results"]["erratum"][label]
        assert e["n_error"] == r["n_error"] == 0
        assert r["hit_rate"] > 0.85 > 0.2 > e["hit_rate"]  # 1k tokens: the prefix is ~96 % of it
        if r["n_agreement"]:
            assert 0.0 <= r["decision_agreement"] <= 1.0
        else:  # agreement pairs completed requests only; a slow machine can censor them all
            assert math.isnan(r["decision_agreement"]) and e["n_censored"] + r["n_censored"] > 0
    seq_e, seq_r = s["results"]["edit"]["sequential"], s["results"]["erratum"]["sequential"]
    assert seq_e["n_censored"] == seq_r["n_censored"] == 0  # sequential requests are never cut
    assert seq_r["n_agreement"] == 2 and 0.0 <= seq_r["decision_agreement"] <= 1.0
    seq = s["results"]
    assert seq["edit"]["sequential"]["ttft_p50_s"] > seq["erratum"]["sequential"]["ttft_p50_s"]
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "completed"
