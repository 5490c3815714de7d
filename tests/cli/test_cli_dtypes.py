"""Every command that loads a target starts, answers and exits 0 with every ``--dtype``: ``generate``,
``enumerate``, ``rank``, ``audit`` and ``serve`` (in-process, one completion over HTTP), on a tiny random
Hugging Face Llama saved to disk. A precision is a target of its own: the answers are checked to be
well formed (finite scores, ordered, within the asked sizes), not equal across precisions."""
from __future__ import annotations

import json
import math
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.cli import main  # noqa: E402
from speculum.models.hf.precision import DTYPES  # noqa: E402

# q8 multiplies a GGUF file's weight groups: a model directory has none, and is refused (test_cli_dtypes.py).
DIRECTORY_DTYPES = [dtype for dtype in DTYPES if dtype != "q8"]

WORDS = ["1", "2", "3", "12", "23", "x", "y"]
PROMPT = "x y"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("dtypes") / "tiny", words=WORDS))


def run_json(capsys, argv: list[str]) -> dict:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Traceback" not in captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", DIRECTORY_DTYPES)
def test_generate_runs_with_every_dtype(capsys, tiny_dir, dtype):
    reply = run_json(capsys, ["generate", PROMPT, "--target", tiny_dir, "--dtype", dtype, "--raw",
                              "--max-new-tokens", "5", "--json"])
    assert 1 <= len(reply["tokens"]) <= 5
    assert len(reply["token_logprobs"]) == len(reply["tokens"])
    assert all(math.isfinite(x) and x <= 1e-6 for x in reply["token_logprobs"])


@pytest.mark.parametrize("dtype", DIRECTORY_DTYPES)
def test_enumerate_runs_with_every_dtype(capsys, tiny_dir, dtype):
    reply = run_json(capsys, ["enumerate", PROMPT, "--target", tiny_dir, "--dtype", dtype, "--raw",
                              "--length", "2", "--top-k", "4", "--json"])
    scores = [item["target_log_prob"] for item in reply["items"]]
    assert len(scores) == 4 and all(math.isfinite(s) and s <= 1e-6 for s in scores)
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("dtype", DIRECTORY_DTYPES)
def test_rank_runs_with_every_dtype(capsys, tiny_dir, dtype):
    reply = run_json(capsys, ["rank", PROMPT, "--target", tiny_dir, "--dtype", dtype, "--raw",
                              "--text", "1 2", "--json"])
    items = reply.get("items", [reply])
    assert all(item["rank"] >= 0 and math.isfinite(item["log_prob"]) for item in items)


@pytest.mark.parametrize("dtype", DIRECTORY_DTYPES)
def test_audit_runs_with_every_dtype(capsys, tmp_path, tiny_dir, dtype):
    canaries = tmp_path / "canaries.txt"
    canaries.write_text("12 3\n2 2 1\n")
    reply = run_json(capsys, ["audit", str(canaries), "--prompt", PROMPT, "--regex", "[123]{3}", "--target",
                              tiny_dir, "--dtype", dtype, "--raw", "--method", "exact", "--json"])
    assert [item["canary"] for item in reply["items"]] == ["12 3", "2 2 1"]
    assert all(item["method"] == "exact" and 0 <= item["rank"] < reply["space_size"] for item in reply["items"])


def _answer_one_completion(monkeypatch) -> dict:
    """Make ``speculum serve`` answer one completion over HTTP, then stop: the real command runs in-process,
    a helper thread sends the request once uvicorn listens and then asks the server to exit."""
    import httpx

    import speculum.cli.serve as serve_cli

    serve = serve_cli.serve_on_this_thread
    answer: dict = {}

    def serve_then_stop(server, engine, **options):
        def client() -> None:
            try:
                deadline = time.monotonic() + 60
                while not server.started:
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.02)
                port = server.servers[0].sockets[0].getsockname()[1]
                reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                   json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1})
                answer.update(status=reply.status_code, body=reply.json())
            finally:
                server.should_exit = True

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        try:
            return serve(server, engine, **options)
        finally:
            thread.join(60)

    monkeypatch.setattr(serve_cli, "serve_on_this_thread", serve_then_stop)
    return answer


@pytest.mark.parametrize("dtype", DIRECTORY_DTYPES)
def test_serve_runs_with_every_dtype(capsys, monkeypatch, tiny_dir, dtype):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    answer = _answer_one_completion(monkeypatch)
    code = main(["serve", "--target", tiny_dir, "--dtype", dtype, "--port", "0"])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.err, captured.err
    assert answer.get("status") == 200, answer
    assert answer["body"]["usage"]["completion_tokens"] >= 1


def test_q8_on_a_model_directory_is_refused_in_one_line(capsys, tiny_dir):
    code = main(["generate", PROMPT, "--target", tiny_dir, "--dtype", "q8", "--raw", "--max-new-tokens", "2"])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err
    from speculum.models.hf.kernels.q8_groups import q8_unavailable

    # The first cause found names the refusal: no kernel here (no compiler, SPECULUM_KERNELS=off), else no groups.
    reason = q8_unavailable()
    expected = (f"q8 needs its compiled kernel: {reason}" if reason is not None
                else "q8 multiplies a GGUF file's weight groups: load a GGUF file or the embedded model")
    assert expected in captured.err
