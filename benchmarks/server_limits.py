"""A bounded load script against the real `speculum serve` (a subprocess on 127.0.0.1, the embedded
SmolLM2-135M-Instruct): one request must never stall the others.

Four phases, each checked, with `/health` polled every 50 ms throughout (its largest latency reported):

1. **Burst**: `--burst` (120) greedy requests at once at `--max-batch 8 --max-waiting 8`: how many got 429
   (with `Retry-After`), and whether every answered one equals that prompt's greedy answer asked alone
   (no lost or mixed answers).
2. **A 20 MB body** sent while requests run: the time to its 413 and `/health`'s latency meanwhile
   (goal: < 1 s).
3. **8 disconnecting clients**: non-streamed 2,000-token requests whose clients give up after 1 s; the
   server must cancel them (`requests_disconnected_total` 8, nothing left running) and answer the next.
4. **A generation beside a long echo**: a 4-token greedy generation's latency alone, then while an
   `--echo-tokens` (8,000) prompt is scored (`echo`, `logprobs: 20`, `max_tokens: 0`), measured side by
   side: the ratio must stay within 3x. The echo's client then gives up: the server must stop scoring
   it within one round (`scoring_forwards_total` grows by at most one after it is gone) and count it as
   a disconnected request.
5. **An oversized batch**: a list of more prompts than `--max-batch` + `--max-waiting` must get 400 naming
   `prompt` and admit nothing (`requests_finished_total` unchanged).
6. **SIGTERM with open streams**: two streams open, the server is sent SIGTERM; both must end with `[DONE]`
   (the long one after an error event) and the process must end as stopped by SIGTERM.

    .venv/bin/python benchmarks/server_limits.py            # ~3 min on 2 cores
    .venv/bin/python benchmarks/server_limits.py --json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class HealthProbe:
    """Polls ``/health`` on a thread; ``worst`` is the largest latency seen (a failed probe counts as its
    time to fail)."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.failures, self._stop = url, 0.0, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    client.get(f"{self.url}/health").raise_for_status()
                except httpx.HTTPError:
                    self.failures += 1
                self.worst = max(self.worst, time.monotonic() - began)
                self._stop.wait(0.05)

    def __enter__(self) -> "HealthProbe":
        self.worst, self.failures = 0.0, 0
        self._stop.clear()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join()


def complete(url: str, prompt: str, timeout: float = 300, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout,
                      json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0} | fields)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def echo_phase(url: str, prompt: str, echo_tokens: int) -> dict:
    """A 4-token generation's latency alone and beside an echo of ``echo_tokens`` tokens (medians of 3,
    side by side), then how many scoring rounds ran after the echo's client left."""
    def latency() -> float:
        began = time.monotonic()
        complete(url, prompt, max_tokens=4, temperature=0)
        return time.monotonic() - began

    alone = sorted(latency() for _ in range(3))[1]
    ids = [1000 + (i * 7919) % 39000 for i in range(echo_tokens)]      # ordinary tokens, no specials
    give_up_after = max(5.0, 12 * alone)
    gave_up = threading.Event()

    def echo() -> None:
        try:
            complete(url, ids, timeout=give_up_after, echo=True, logprobs=20, max_tokens=0)
        except httpx.TimeoutException:
            pass
        gave_up.set()

    before = metrics(url)
    thread = threading.Thread(target=echo)
    thread.start()
    while metrics(url)["speculum_scoring_forwards_total"] == before["speculum_scoring_forwards_total"]:
        time.sleep(0.05)
    beside = sorted(latency() for _ in range(3))[1]
    gave_up.wait()
    left = metrics(url)["speculum_scoring_forwards_total"]
    began = time.monotonic()
    while (metrics(url)["speculum_requests_disconnected_total"] == before["speculum_requests_disconnected_total"]
           and time.monotonic() - began < 30):
        time.sleep(0.02)
    time.sleep(0.5)
    after = metrics(url)
    thread.join()
    alone = (alone + sorted(latency() for _ in range(3))[1]) / 2        # before and after, side by side
    return {"echo_tokens": echo_tokens, "generation_alone_s": round(alone, 3),
            "generation_beside_echo_s": round(beside, 3), "latency_ratio": round(beside / alone, 2),
            "rounds_after_client_left": int(after["speculum_scoring_forwards_total"] - left),
            "cancelled_by_server": int(after["speculum_requests_disconnected_total"]
                                       - before["speculum_requests_disconnected_total"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=120, help="requests sent at once (default: 120)")
    parser.add_argument("--echo-tokens", type=int, default=8000, help="tokens of the echoed prompt (default: 8000)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "speculum", "serve", "--port", str(port), "--max-batch", "8",
               "--max-waiting", "8", "--shutdown-timeout", "2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    report: dict = {"cpu": cpu_name(), "command": " ".join(command[1:])}
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(server.stderr.read().decode())
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        prompts = [f"Write the number {i} in words, then in Roman numerals:" for i in range(args.burst)]

        # 1. Burst
        with HealthProbe(url) as probe, ThreadPoolExecutor(args.burst) as pool:
            began = time.monotonic()
            replies = list(pool.map(lambda p: complete(url, p), prompts))
            burst_seconds = time.monotonic() - began
        answered = {p: r.json()["choices"][0]["text"] for p, r in zip(prompts, replies) if r.status_code == 200}
        refused = [r for r in replies if r.status_code == 429]
        other = [r.status_code for r in replies if r.status_code not in (200, 429)]
        solo = {p: complete(url, p).json()["choices"][0]["text"] for p in answered}     # one at a time
        report["burst"] = {"requests": args.burst, "answered": len(answered), "refused_429": len(refused),
                           "retry_after_on_every_429": all(r.headers.get("retry-after") for r in refused),
                           "other_statuses": other, "seconds": round(burst_seconds, 2),
                           "answers_equal_solo": sum(answered[p] == solo[p] for p in answered),
                           "largest_health_latency_s": round(probe.worst, 3), "health_failures": probe.failures}

        # 2. A 20 MB body while requests run
        body = json.dumps({"prompt": "x" * (20 * 1024 * 1024)}).encode()
        with HealthProbe(url) as probe, ThreadPoolExecutor(9) as pool:
            running = [pool.submit(complete, url, p) for p in prompts[:8]]
            time.sleep(0.5)
            began = time.monotonic()
            try:
                big = httpx.post(f"{url}/v1/completions", content=body, timeout=60,
                                 headers={"Content-Type": "application/json"})
                big_status = big.status_code
            except httpx.HTTPError as exc:          # the server may close before the whole body is sent
                big_status = f"connection closed ({type(exc).__name__})"
            big_seconds = time.monotonic() - began
            during = [r.result() for r in running]
        report["big_body"] = {"bytes": len(body), "status": big_status, "seconds": round(big_seconds, 3),
                              "largest_health_latency_s": round(probe.worst, 3),
                              "running_requests_answered": sum(r.status_code == 200 for r in during),
                              "running_answers_equal_solo": sum(r.json()["choices"][0]["text"] == solo.get(p, r.json()["choices"][0]["text"])
                                                                for p, r in zip(prompts[:8], during) if r.status_code == 200)}

        # 3. Eight clients that give up after 1 s
        before = metrics(url)
        with HealthProbe(url) as probe, ThreadPoolExecutor(8) as pool:
            def give_up(prompt: str) -> str:
                try:
                    complete(url, prompt, timeout=1.0, max_tokens=2000)
                    return "answered"
                except httpx.TimeoutException:
                    return "gave up"
            outcomes = list(pool.map(give_up, prompts[:8]))
            began = time.monotonic()
            while metrics(url)["speculum_requests_running"] > 0 and time.monotonic() - began < 30:
                time.sleep(0.1)
            freed = time.monotonic() - began
        after = metrics(url)
        follow = complete(url, prompts[0])
        report["disconnects"] = {
            "clients_gave_up": outcomes.count("gave up"),
            "cancelled_by_server": int(after["speculum_requests_disconnected_total"]
                                       - before["speculum_requests_disconnected_total"]),
            "seconds_until_nothing_runs": round(freed, 2), "next_request_status": follow.status_code,
            "largest_health_latency_s": round(probe.worst, 3)}

        # 4. A 4-token generation beside a long echo, then the echo's client gives up
        report["echo"] = echo_phase(url, prompts[2], args.echo_tokens)

        # 5. A batch larger than the bound
        before = metrics(url)
        batch = complete(url, [prompts[0]] * 17, max_tokens=2)          # --max-batch 8 + --max-waiting 8, + 1
        after = metrics(url)
        report["oversized_batch"] = {
            "prompts": 17, "status": batch.status_code, "param": batch.json().get("error", {}).get("param"),
            "requests_finished_meanwhile": int(after["speculum_requests_finished_total"]
                                               - before["speculum_requests_finished_total"])}

        # 6. SIGTERM with two open streams
        opened = threading.Barrier(3)

        def stream(max_tokens: int) -> list[str]:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                              json={"prompt": prompts[1], "max_tokens": max_tokens, "temperature": 0,
                                    "stream": True}) as reply:
                lines = reply.iter_lines()
                out = [next(lines)]
                opened.wait(30)
                return out + [line for line in lines if line]

        with ThreadPoolExecutor(2) as pool:
            short, long = pool.submit(stream, 12), pool.submit(stream, 4000)
            opened.wait(30)
            began = time.monotonic()
            server.send_signal(signal.SIGTERM)
            short, long = short.result(), long.result()
            code = server.wait(60)
        stderr = server.stderr.read().decode()
        report["sigterm"] = {
            "seconds_to_exit": round(time.monotonic() - began, 2), "exit_status": code,
            "ended_as_sigterm": code == -signal.SIGTERM,
            "short_stream": "finished" if short[-1] == "data: [DONE]" and '"finish_reason": "length"' in short[-2]
            else short[-2:],
            "long_stream": "error event + [DONE]" if long[-1] == "data: [DONE]" and '"error"' in long[-2]
            else long[-2:],
            "traceback_in_log": "Traceback" in stderr}
        if "Traceback" in stderr:
            report["sigterm"]["log"] = stderr[stderr.index("Traceback"):][-3000:]
    finally:
        if server.poll() is None:
            server.kill()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"# speculum serve under adversarial load, {report['cpu']}\n")
        for phase in ("burst", "big_body", "disconnects", "echo", "oversized_batch", "sigterm"):
            print(f"{phase}:")
            for key, value in report[phase].items():
                print(f"  {key}: {value}")
    ok = (report["burst"]["answers_equal_solo"] == report["burst"]["answered"]
          and report["burst"]["answered"] + report["burst"]["refused_429"] == args.burst
          and report["big_body"]["largest_health_latency_s"] < 1.0
          # every client that gave up was cancelled (a generation that ends, at eos, within the second is not)
          and report["disconnects"]["clients_gave_up"] >= 1
          and report["disconnects"]["cancelled_by_server"] == report["disconnects"]["clients_gave_up"]
          and report["sigterm"]["ended_as_sigterm"]
          and report["echo"]["latency_ratio"] <= 3.0 and report["echo"]["rounds_after_client_left"] <= 1
          and report["echo"]["cancelled_by_server"] == 1
          and report["oversized_batch"]["status"] == 400 and report["oversized_batch"]["param"] == "prompt"
          and report["oversized_batch"]["requests_finished_meanwhile"] == 0
          and not report["sigterm"]["traceback_in_log"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
