"""OpenVINO GenAI's continuous-batching pipeline behind a minimal `/v1/completions`, for `serving_peers.py`.

`serving_peers.py` drives every server with the same HTTP clients and reads each one's resident memory from
its process, so OpenVINO GenAI runs here as a server too: a `ContinuousBatchingPipeline` on a GGUF file
(OpenVINO GenAI reads F16, Q8_0 and Q4 GGUF files directly; not F32), one thread calling its `step()` for
every running request, requests joining between steps. Greedy, `--max-batch` sequences at most, no prefix
caching (as `cache_prompt: false` for llama-server), and optionally its prompt-lookup decoding
(`--prompt-lookup`: `num_assistant_tokens` 5, `max_ngram_size` 3, its documented example's setting).

    .venv/bin/python benchmarks/openvino_server.py --model F16.gguf --port 8000 --precision f32

Answers `POST /v1/completions` (`prompt` text, `max_tokens`; greedy whatever `temperature` says) with
`choices[0].text` and `usage.completion_tokens`, and `GET /health`. Needs the `[bench]` extra.
"""
from __future__ import annotations

import argparse
import itertools
import threading
from concurrent.futures import Future

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


class Completion(BaseModel):
    prompt: str
    max_tokens: int = 16
    temperature: float = 0.0


class Runner:
    """Requests in, one thread stepping the pipeline over all of them, answers out as futures."""

    def __init__(self, pipe, tokenizer, prompt_lookup: bool) -> None:
        self.pipe, self.tokenizer, self.prompt_lookup = pipe, tokenizer, prompt_lookup
        self.waiting: list[tuple[int, str, int, Future]] = []
        self.running: dict[int, tuple[object, Future]] = {}
        self.ids = itertools.count()
        self.wake = threading.Condition()
        threading.Thread(target=self.loop, name="openvino-steps", daemon=True).start()

    def submit(self, prompt: str, max_tokens: int) -> Future:
        done: Future = Future()
        with self.wake:
            self.waiting.append((next(self.ids), prompt, max_tokens, done))
            self.wake.notify()
        return done

    def config(self, max_tokens: int):
        import openvino_genai as ov_genai

        config = ov_genai.GenerationConfig()
        config.max_new_tokens, config.do_sample, config.apply_chat_template = max_tokens, False, False
        if self.prompt_lookup:
            config.num_assistant_tokens, config.max_ngram_size = 5, 3
        return config

    def loop(self) -> None:
        import openvino_genai as ov_genai

        while True:
            with self.wake:
                while not self.waiting and not self.running:
                    self.wake.wait()
                joining, self.waiting = self.waiting, []
            try:
                for ident, prompt, max_tokens, done in joining:
                    self.running[ident] = (self.pipe.add_request(ident, prompt, self.config(max_tokens)), done)
                self.pipe.step()
                for ident, (handle, done) in list(self.running.items()):
                    if handle.get_status() != ov_genai.GenerationStatus.RUNNING:
                        del self.running[ident]
                        outputs = handle.read_all()
                        if not outputs:
                            done.set_exception(RuntimeError(f"request ended {handle.get_status()} without output"))
                            continue
                        ids = list(outputs[0].generated_ids)
                        done.set_result((self.tokenizer.decode(ids), len(ids)))
            except Exception as exc:      # a failing step fails the requests it held, not the server
                for done in [done for _, done in self.running.values()] + [item[-1] for item in joining]:
                    if not done.done():
                        done.set_exception(exc)
                self.running.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file (F16, Q8_0 or Q4)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--precision", choices=["default", "f32", "bf16"], default="default",
                        help="the CPU plugin's inference precision (default: its own choice, bf16 where the "
                             "CPU has AMX or AVX-512 BF16)")
    parser.add_argument("--prompt-lookup", action="store_true")
    args = parser.parse_args()
    import openvino_genai as ov_genai

    scheduler = ov_genai.SchedulerConfig()
    scheduler.max_num_seqs, scheduler.enable_prefix_caching, scheduler.cache_size = args.max_batch, False, 1
    properties: dict = {"prompt_lookup": True} if args.prompt_lookup else {}
    if args.precision != "default":
        properties["INFERENCE_PRECISION_HINT"] = args.precision
    pipe = ov_genai.ContinuousBatchingPipeline(args.model, scheduler, "CPU", properties)
    runner = Runner(pipe, pipe.get_tokenizer(), args.prompt_lookup)
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/completions")
    def complete(body: Completion) -> dict:
        text, tokens = runner.submit(body.prompt, body.max_tokens).result()
        return {"choices": [{"text": text, "index": 0, "finish_reason": "stop"}],
                "usage": {"completion_tokens": tokens}}

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
