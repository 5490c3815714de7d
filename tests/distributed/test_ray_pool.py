"""RayPool on a local Ray cluster (this machine's CPUs): rows, scores and every enumeration query identical
to the local model's, an actor killed during a query, an unreachable cluster, bad input."""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from functools import partial

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from speculum.enumeration import AutoregressiveEnumerable, Regex  # noqa: E402
from speculum.models import MarkovModel  # noqa: E402
from speculum.distributed.ray_pool import ClusterUnreachableError, ModelSpec, RayPool  # noqa: E402
from speculum.models.reference.tiny_transformer import TinyTransformer  # noqa: E402
from speculum.validation import InputError  # noqa: E402

TINY = partial(TinyTransformer, 40, d_model=32, n_layers=2, seed=5)
VOCAB = ["7", "8", "77", "x", "y", "xy", None]      # id 6 has no text: the eos
MARKOV = partial(MarkovModel.random, len(VOCAB), seed=4, eos_token_id=6)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance for the module (starting one costs seconds); pools come and go on it. Its 8
    logical CPUs let several pools' actors (1 CPU each on an existing cluster) live side by side."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_pool(cluster):
    with RayPool(TINY, workers=2) as pool:
        yield pool


def queries(model, **index):
    """Every query kind on a fresh index: the k best, an unrank, a rank, a count and a threshold."""
    ar = AutoregressiveEnumerable(model, **index)
    top = ar.top_k(300)
    return {"top_k": top, "unrank": ar.unrank(250), "rank": ar.rank(top[123][0]),
            "count": ar.count(top[200][1]), "threshold": ar.threshold(280)}


def test_rows_and_scores_bitwise_equal_to_the_local_model(tiny_pool):
    local = TINY()
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 40, size=rng.integers(1, 7)).tolist() for _ in range(150)]
    assert np.array_equal(tiny_pool.next_logprobs(prefixes), local.next_logprobs(prefixes))
    assert np.array_equal(tiny_pool.score_sequences(prefixes, prompt=[3]), local.score_sequences(prefixes, prompt=[3]))
    batches = [(prefixes[i: i + 20],) for i in range(0, 150, 20)]
    for got, batch in zip(tiny_pool.map_calls("next_logprobs", batches), batches):
        assert np.array_equal(got, local.next_logprobs(*batch))


@pytest.mark.parametrize("index", [dict(max_len=4, prompt=[1], batch_size=16),
                                   dict(max_len=5, eos=7, prompt=[2], batch_size=8)])
def test_queries_identical_to_the_local_model(tiny_pool, index):
    before = [w.calls for w in tiny_pool.stats.workers]
    assert queries(tiny_pool, **index) == queries(TINY(), **index)
    used = [w.calls - b for w, b in zip(tiny_pool.stats.workers, before)]
    assert min(used) > 0, "both workers took part"


def test_constrained_query_identical_to_the_local_model(cluster):
    with RayPool(MARKOV, workers=2) as pool:
        results = []
        for model in (pool, MARKOV()):
            ar = AutoregressiveEnumerable(model, prompt=[3], constraint=Regex("[78]+x?", vocabulary=VOCAB), eos=6,
                                          max_len=6, batch_size=4)
            top = ar.top_k(40)
            results.append((top, ar.rank(top[17][0]), ar.count(top[30][1]), ar.unrank(33), ar.mass()))
        assert results[0] == results[1]


def test_actor_killed_during_a_query_is_replaced_and_nothing_changes(cluster):
    index = dict(max_len=4, prompt=[1], batch_size=4)
    expected = queries(TINY(), **index)
    with RayPool(TINY, workers=2) as pool:
        victim = pool.worker_pids()[0]
        killed = threading.Event()

        def kill_after_some_calls() -> None:
            deadline = time.monotonic() + 60
            while sum(w.calls for w in pool.stats.workers) < 20 and time.monotonic() < deadline:
                time.sleep(0.001)
            os.kill(victim, signal.SIGKILL)
            killed.set()

        killer = threading.Thread(target=kill_after_some_calls, daemon=True)
        killer.start()
        got = queries(pool, **index)
        killer.join(5)
        assert killed.is_set()
        assert got == expected
        assert pool.stats.replaced >= 1 and pool.stats.retries >= 1
        assert victim not in pool.worker_pids()


def test_unreachable_cluster_is_one_line(tmp_path):
    with socket.socket() as probe:              # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ClusterUnreachableError) as caught:
        RayPool(TINY, workers=1, address=f"127.0.0.1:{port}")
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert "\n" not in message and f"127.0.0.1:{port}" in message
    with pytest.raises(InputError, match="HOST:PORT"):
        RayPool(TINY, workers=1, address="nowhere")


def test_bad_input_names_the_callers_index(tiny_pool):
    with pytest.raises(InputError, match=r"prefixes\[1\]"):
        tiny_pool.next_logprobs([[1, 2], [1, 99]])
    with pytest.raises(InputError, match="no sparse rows"):
        tiny_pool.next_logprobs_above([[1]], [-1.0, -2.0])
    with pytest.raises(InputError, match="workers"):
        RayPool(TINY, workers=0)
    with pytest.raises(InputError, match="spec"):
        RayPool(42, workers=1)
    with pytest.raises(InputError, match="free CPUs"):
        RayPool(TINY, workers=3, cpus_per_worker=4)


def test_an_error_inside_the_model_reaches_the_caller_as_itself(tiny_pool):
    """The model's own refusal (a prefix longer than its context) comes back as its InputError."""
    with pytest.raises(InputError, match="max_len"):
        tiny_pool.next_logprobs([[1] * 300])


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'speculum\[ray\]'"):
        RayPool(TINY, workers=1)


def test_sessions_and_tokenizer_come_from_the_local_copy(tiny_pool):
    session = tiny_pool.start([1, 2])
    assert np.array_equal(session.next_logprobs(), TINY().start([1, 2]).next_logprobs())
    assert tiny_pool.vocab_size == 40 and tiny_pool.capabilities.parallel_calls == 4


@pytest.mark.slow
def test_smollm2_enumeration_on_two_workers_is_bitwise_the_local_one(cluster):
    import speculum

    local = speculum.load_model(progress=False)
    prompt = local.encode("Name a colour:")
    index = dict(max_len=3, prompt=prompt, batch_size=64)
    expected = queries(local, **index)
    with RayPool(ModelSpec(), workers=2) as pool:
        assert queries(pool, **index) == expected


# ------------------------------------------------------------------------------------------------ CLI
REFERENCE = partial(MarkovModel.random, 6, seed=0, eos_token_id=5)   # the CLI tests' reference target


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from speculum.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", [["enumerate", "1 2", "--length", "4", "--top-k", "30"],
                                     ["rank", "1 2", "--text", "3 1 4"]])
def test_cli_workers_answer_as_the_local_run(cluster, reference_target, monkeypatch, capsys, command):
    import json

    import speculum.cli.enumerate as enumerate_cli

    monkeypatch.setattr(enumerate_cli, "_worker_spec", lambda args: REFERENCE)
    code, local, _ = run_cli(capsys, *command, "--target", reference_target, "--json")
    assert code == 0
    code, pooled, err = run_cli(capsys, *command, "--target", reference_target, "--json", "--workers", "2")
    assert code == 0, err

    def answer(text: str) -> dict:
        report = json.loads(text)
        report.pop("seconds", None)
        return report

    assert answer(pooled) == answer(local)


def test_cli_unreachable_cluster_and_missing_ray(reference_target, monkeypatch, capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, _, err = run_cli(capsys, "enumerate", "1 2", "--length", "2", "--top-k", "3", "--target", reference_target,
                           "--ray-address", f"127.0.0.1:{port}")
    assert code == 2 and f"cannot reach the Ray cluster at 127.0.0.1:{port}" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "rank", "1 2", "--text", "3", "--target", reference_target, "--workers", "0")
    assert code == 2 and "--workers" in err
    monkeypatch.setitem(sys.modules, "ray", None)
    code, _, err = run_cli(capsys, "enumerate", "1 2", "--length", "2", "--top-k", "3", "--target", reference_target,
                           "--workers", "2")
    assert code == 2 and "pip install 'speculum[ray]'" in err


def test_workers_wait_passively_at_openmp_barriers(tiny_pool):
    """Workers share cores with each other and the caller: their OpenMP threads must not spin (the policy
    travels in each actor's environment, read when torch loads there)."""
    import os

    expected = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert [info["omp_wait_policy"] for info in tiny_pool.worker_info()] == [expected, expected]


# ------------------------------------------------------------------------------------------ kernels
PATHS = {"kernels_off": None, "grouped": "a3acb240f156", "tiles": None, "cpu_flags": ["avx2", "avx512f", "fma"]}


def test_a_worker_on_other_kernels_is_named_in_one_line():
    from speculum.distributed.ray_pool import kernel_mismatch

    assert kernel_mismatch([PATHS, dict(PATHS)], PATHS) is None
    assert kernel_mismatch([None, None], None) is None                  # another backend: nothing to compare
    reason = kernel_mismatch([PATHS, {**PATHS, "cpu_flags": ["avx2", "fma"]}], PATHS)
    assert reason.startswith("Ray worker 1 ") and "cpu_flags" in reason and "SPECULUM_KERNELS=off" in reason
    assert "\n" not in reason
    assert "grouped" in kernel_mismatch([{**PATHS, "grouped": None}], PATHS)


def test_a_pool_whose_workers_turn_the_kernels_off_alone_is_refused(cluster, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.delenv("SPECULUM_KERNELS", raising=False)       # on here, off there

    def kernels_off_there():
        os.environ["SPECULUM_KERNELS"] = "off"
        import speculum.models.hf.kernels.products  # noqa: F401  (a model on the PyTorch backend)
        return TINY()

    with pytest.raises(InputError, match="Ray worker 0 multiplies on other kernels than this process"):
        RayPool(kernels_off_there, workers=1)


def test_kernels_off_here_reaches_every_worker(cluster, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("SPECULUM_KERNELS", "off")

    def on_the_pytorch_backend():
        import speculum.models.hf.kernels.products  # noqa: F401  (a model on the PyTorch backend)
        return TINY()

    with RayPool(on_the_pytorch_backend, workers=1) as pool:
        reports = [info["products"] for info in pool.worker_info()]
    assert all(report["kernels_off"] and report["grouped"] is None for report in reports)
