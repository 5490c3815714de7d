"""The strongest CPU serving peers, built offline for side-by-side benchmarks (not part of `make test`).

`setup` builds llama.cpp's C++ `llama-server` (continuous batching, `--spec-type` n-gram speculation) and
`llama-quantize` from the llama.cpp tree vendored in the `llama-cpp-python` sdist (downloaded from PyPI
with `pip download --no-binary`), into a cache folder, and converts speculum's cached float32 checkpoint of
the embedded model (the embedded Q4_1 weights expanded, the very target speculum serves) to F32, F16 and
Q8_0 GGUF files with the vendored converter. Re-running skips what is already there.

    .venv/bin/python benchmarks/peers.py setup          # ~16 min on 2 cores (the C++ build)
    .venv/bin/python benchmarks/peers.py paths          # where the binaries and GGUF files are (JSON)

`benchmarks/serving_peers.py` then runs llama-server beside `speculum serve`. OpenVINO GenAI, the other
peer, comes with the `[bench]` extra (which `make` installs) and reads the F16 and Q8_0 files made here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
TARGETS = ("llama-server", "llama-quantize")


def cache_root() -> Path:
    base = os.environ.get("SPECULUM_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                            os.path.expanduser("~/.cache"), "speculum")
    return Path(base) / "peers"


def paths() -> dict:
    root = cache_root()
    return {"root": str(root), "llama_server": str(root / "build" / "bin" / "llama-server"),
            "llama_quantize": str(root / "build" / "bin" / "llama-quantize"),
            "gguf": {kind: str(root / "gguf" / f"smollm2-135m-{kind.lower()}.gguf") for kind in ("F32", "F16", "Q8_0")}}


def cmake_flags() -> list[str]:
    """A Release build for this CPU's vector extensions, named explicitly (not -march=native: a native build
    on a CPU with AMX uses AMX kernels that crash where the sandbox does not grant the AMX tile state)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from speculum.models.hf.precision import cpu_flags    # the one reader of /proc/cpuinfo's flags

    flags = cpu_flags()
    wanted = {"AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
              "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16"}
    return ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF"] + [
        f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for name, flag in wanted.items()]


def run(command: list[str], **kwargs) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, **kwargs)


def vendored_tree(root: Path) -> Path:
    tree = root / "src" / "llama.cpp"
    if tree.is_dir():
        return tree
    download = root / "download"
    download.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", LLAMA_CPP_PYTHON,
         "-d", str(download)])
    archive = next(download.glob("llama_cpp_python-*.tar.gz"))
    prefix = archive.name[: -len(".tar.gz")] + "/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(tree, members=[m for m in members if m.name], filter="data")
    return tree


def build(root: Path, tree: Path, jobs: int) -> None:
    found = paths()
    if all(Path(found[key]).exists() for key in ("llama_server", "llama_quantize")):
        return
    build_dir = root / "build"
    run(["cmake", "-S", str(tree), "-B", str(build_dir)] + cmake_flags())
    run(["cmake", "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs)])


def convert(tree: Path) -> None:
    """F32 and F16 with the vendored converter (its own gguf-py first on the path), Q8_0 with llama-quantize."""
    found = paths()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    try:                                             # the cached float32 checkpoint of the embedded model
        from speculum.models.paths import cache_dir
    except ImportError:
        from speculum.models.paths import cache_dir

    checkpoint = next(Path(cache_dir()).glob("smollm2-135m-float32*"), None)
    if checkpoint is None:
        raise SystemExit("no cached checkpoint: run `speculum generate 'hi' --max-new-tokens 1` once first")
    out = Path(found["gguf"]["F32"]).parent
    out.mkdir(parents=True, exist_ok=True)
    # The converter imports sentencepiece even for BPE tokenizers: an empty stand-in is enough for them.
    stub = out / "stubs"
    stub.mkdir(exist_ok=True)
    (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "gguf-py"), str(stub)]), NO_LOCAL_GGUF="")
    for kind in ("F32", "F16"):
        if not Path(found["gguf"][kind]).exists():
            run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", kind.lower(),
                 "--outfile", found["gguf"][kind]], env=env)
    if not Path(found["gguf"]["Q8_0"]).exists():
        run([found["llama_quantize"], found["gguf"]["F32"], found["gguf"]["Q8_0"], "Q8_0"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    setup = sub.add_parser("setup", help="build llama-server and convert the GGUF files (skips what exists)")
    setup.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel build jobs")
    sub.add_parser("paths", help="print where the binaries and GGUF files are, as JSON")
    args = parser.parse_args()
    if args.command == "paths":
        print(json.dumps(paths(), indent=2))
        return 0
    if shutil.which("cmake") is None:
        raise SystemExit("peers.py setup needs cmake and a C++ compiler")
    root = cache_root()
    tree = vendored_tree(root)
    build(root, tree, args.jobs)
    convert(tree)
    print(json.dumps(paths(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
