"""``speculum serve --dtype D`` for every precision the PyTorch backend offers: the server ``serve`` builds
(target loaded, draft built, unpacked weights given back) answers a greedy completion with the tokens of
plain greedy decoding at that precision."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402

import speculum  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.cli import build_parser  # noqa: E402
from speculum.cli.serve import build_server  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.precision import DTYPES  # noqa: E402

# q8 multiplies a GGUF file's weight groups: a model directory has none, and is refused (test_cli_dtypes.py).
DIRECTORY_DTYPES = [dtype for dtype in DTYPES if dtype != "q8"]

PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("serve-dtypes") / "tiny"))


@pytest.mark.filterwarnings("ignore:dtype=")
@pytest.mark.parametrize("dtype", DIRECTORY_DTYPES)
def test_serve_starts_and_answers_greedy_at_every_dtype(tiny_dir, dtype):
    args = build_parser().parse_args(["serve", "--target", tiny_dir, "--dtype", dtype])
    engine, app = build_server(args, background=True)
    with TestClient(app) as client:
        reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert reply.status_code == 200, reply.text
    alone = HFModel.from_pretrained(tiny_dir, dtype=dtype)
    expected = speculum.generate(alone, alone.encode(PROMPT, chat=False), max_new_tokens=6, temperature=0.0)
    assert reply.json()["choices"][0]["text"] == alone.decode(expected.tokens)
