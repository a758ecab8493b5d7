#!/usr/bin/env python3
"""HTTP client of tests/gpu/serve_check.sh (standard library only: the GPU machines have
python3 but none of Debian's packages). Subcommands, each printing one line of JSON:

  wait URL SECONDS                  until GET /health/ready answers 200
  complete URL PROMPT N             a greedy completion of N tokens (ignore_eos): its text
  storm URL N                       N streamed completions, each cut by closing its connection
                                    after 0..8 chunks (half of them with a TCP reset)
  settled URL SECONDS [MIN_ABORTS]  until no request runs and every device KV page is free or
                                    cached by no one (the pool is whole), with at least
                                    MIN_ABORTS requests aborted by their client; exits 1 otherwise
  throughput URL CONC TOKENS        CONC concurrent greedy completions of TOKENS tokens: tokens/s
  staging URL SECONDS BACKEND       until a prefill/decode node's KV transfers have ended and every
                                    staging slot is free; with BACKEND cuda, pages must have been
                                    staged (tandem_kv_staging_copies_total > 0); exits 1 otherwise
"""
import http.client
import json
import socket
import struct
import sys
import threading
import time
import urllib.parse


def split(url):
    u = urllib.parse.urlparse(url)
    return u.hostname, u.port


def request(url, method, path, body=None, timeout=120):
    host, port = split(url)
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    c.request(method, path, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def model_id(url):
    status, data = request(url, "GET", "/v1/models")
    if status != 200:
        raise SystemExit(f"GET /v1/models: {status} {data[:200]!r}")
    return json.loads(data)["data"][0]["id"]


def complete(url, prompt, n, model=None):
    body = {"model": model or model_id(url), "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True}
    status, data = request(url, "POST", "/v1/completions", body)
    if status != 200:
        raise SystemExit(f"POST /v1/completions: {status} {data[:300]!r}")
    j = json.loads(data)
    return j["choices"][0]["text"], j["usage"]["completion_tokens"]


def metrics(url):
    status, data = request(url, "GET", "/metrics")
    out = {}
    for line in data.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def cmd_wait(url, seconds):
    until = time.time() + float(seconds)
    while time.time() < until:
        try:
            status, _ = request(url, "GET", "/health/ready", timeout=2)
            if status == 200:
                print(json.dumps({"ready": True}))
                return 0
        except OSError:
            pass
        time.sleep(0.2)
    print(json.dumps({"ready": False}))
    return 1


def cmd_complete(url, prompt, n):
    text, tokens = complete(url, prompt, int(n))
    print(json.dumps({"text": text, "tokens": tokens}))
    return 0


def storm_one(url, model, i, results):
    host, port = split(url)
    body = json.dumps({"model": model, "prompt": f"storm {i}: once upon a time", "max_tokens": 200,
                       "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True}).encode()
    chunks_wanted = i % 9
    try:
        s = socket.create_connection((host, port), timeout=60)
        if i % 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got, buf = 0, b""
        while got < chunks_wanted:
            data = s.recv(65536)
            if not data:
                break
            buf += data
            got = buf.count(b"data:")
        s.close()
        results[i] = got
    except OSError as e:
        results[i] = f"error: {e}"


def cmd_storm(url, n):
    model = model_id(url)
    n = int(n)
    results = [None] * n
    threads = [threading.Thread(target=storm_one, args=(url, model, i, results)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, str)]
    print(json.dumps({"requests": n, "cut": n - len(errors), "errors": errors[:3]}))
    return 1 if errors else 0


def cmd_settled(url, seconds, min_aborts=0):
    until = time.time() + float(seconds)
    keys = ["tandem_requests_running", "tandem_kv_pages_total", "tandem_kv_pages_free", "tandem_kv_pages_cached",
            "tandem_kv_pages_evictable", 'tandem_cache_pages_used{tier="device"}',
            'tandem_cache_pages_cached{tier="device"}', "tandem_worker_staging_buffers_busy",
            "tandem_worker_staging_copies_total", "tandem_http_client_disconnects_total",
            'tandem_requests_finished_total{reason="abort"}']
    m = {}
    while time.time() < until:
        m = metrics(url)
        g = {k: m.get(k) for k in keys}
        whole = (g["tandem_requests_running"] == 0 and g["tandem_kv_pages_evictable"] == g["tandem_kv_pages_cached"]
                 and g['tandem_cache_pages_used{tier="device"}'] == g['tandem_cache_pages_cached{tier="device"}']
                 and g["tandem_kv_pages_free"] + g["tandem_kv_pages_cached"] == g["tandem_kv_pages_total"]
                 and not g["tandem_worker_staging_buffers_busy"]
                 and (g['tandem_requests_finished_total{reason="abort"}'] or 0) >= float(min_aborts))
        if whole:
            print(json.dumps({"whole": True, **g}))
            return 0
        time.sleep(0.25)
    print(json.dumps({"whole": False, **{k: m.get(k) for k in keys}}))
    return 1


def cmd_throughput(url, conc, tokens):
    model = model_id(url)
    conc, tokens = int(conc), int(tokens)
    done = [0] * conc

    def one(i):
        _, n = complete(url, f"throughput {i}: the", tokens, model)
        done[i] = n

    t0 = time.time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.time() - t0
    print(json.dumps({"concurrency": conc, "tokens": sum(done), "seconds": round(dt, 3),
                      "tokens_per_s": round(sum(done) / dt, 1)}))
    return 0


def cmd_staging(url, seconds, backend):
    until = time.time() + float(seconds)
    keys = ["tandem_kv_transfer_live", "tandem_kv_transfer_done_total", "tandem_kv_staging_slots",
            "tandem_kv_staging_slots_in_use", "tandem_kv_staging_copies_total", "tandem_kv_staging_waits_total"]
    g = {}
    while time.time() < until:
        m = metrics(url)
        g = {k: m.get(k) for k in keys}
        done = (g["tandem_kv_transfer_live"] == 0 and (g["tandem_kv_transfer_done_total"] or 0) > 0
                and g["tandem_kv_staging_slots_in_use"] == 0)
        staged = backend == "cpu" or ((g["tandem_kv_staging_copies_total"] or 0) > 0 and g["tandem_kv_staging_slots"])
        if done and staged:
            print(json.dumps(g))
            return 0
        time.sleep(0.25)
    print(json.dumps(g))
    return 1


if __name__ == "__main__":
    cmds = {"wait": cmd_wait, "complete": cmd_complete, "storm": cmd_storm, "settled": cmd_settled,
            "throughput": cmd_throughput, "staging": cmd_staging}
    if len(sys.argv) < 3 or sys.argv[1] not in cmds:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(cmds[sys.argv[1]](*sys.argv[2:]))
