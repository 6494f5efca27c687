"""S-MoE against llama.cpp's CPU build on the same synthetic model, side by side: each case a
fresh process in a memory cgroup (swap off; limited to the cap, or for an uncapped case to the
machine's RAM) after dropping the page cache, the same 44-token prompt, 64 greedy tokens,
2 threads for llama.cpp. Reports per case prefill and decode tok/s (each tool's own timing
figures), the cgroup's peak memory (anonymous memory and page cache), the process's peak RSS,
CPU seconds and wall time, and the ratios S-MoE / llama.cpp (medians over --rounds).

    python bench/llama_cpp.py [--create] [--layers 18] [--models /work/models]
                              [--llama-dir /work/llama] [--cases llama,smoe,...] [--rounds 1]

The model: `smoe synth --preset qwen3-30b-a3b --layers L` (Qwen3-30B-A3B geometry: 128
experts top-8, hidden 2048; vocab 4096), then
  - llama.cpp: convert_hf_to_gguf.py to a bf16 GGUF, `llama-quantize ... Q4_0` (experts and
    attention 4-bit; the bf16 GGUF is deleted afterwards unless --keep-bf16);
  - S-MoE: `smoe convert SRC VAULT` (4-bit experts, float backbone) and `smoe convert SRC
    VAULT4 --backbone-bits 4` (backbone 4-bit too, as Q4_0 quantizes attention).
Missing files are made with --create only (minutes each: 18 layers are ~22 GB of bf16).

llama.cpp comes from the llama-cpp-python sdist (its vendor/llama.cpp), built in --llama-dir
with cmake (CPU only, -DGGML_NATIVE=ON); an existing build is reused unless --rebuild.
convert_hf_to_gguf.py runs in its own venv (--llama-dir/venv, made with --create), never in
this checkout's. Layout of --llama-dir: sdist/*.tar.gz, llama_cpp_python-*/vendor/llama.cpp,
build/bin/llama-{completion,quantize}, venv/.

Cases (--cases, default all; a "-cap" case runs under a cap of the GGUF's bytes / 3):
  llama         llama-completion, Q4_0 GGUF (repacked for AVX2 at load, llama.cpp's default)
  smoe          smoe generate, 4-bit experts, float backbone
  smoe-bb4      smoe generate, 4-bit experts and backbone
  llama-cap     as llama under the cap, with -nr (no repack: a repacked copy needs the whole
                model in anonymous memory); the GGUF is mmapped, so it is page-cache bound
  smoe-cap      as smoe under the cap, with --memory a bit under it (--memory-share)
  smoe-bb4-cap  as smoe-bb4 under the cap

What is compared, exactly:
  - the prompt: llama-completion takes text, not token ids, so both get the same fixed text;
    S-MoE gets the ids of the vault's tokenizer (--prompt-ids), and llama.cpp's own
    tokenization (printed with --verbose-prompt) is checked against them (prompt_ids_match).
  - prefill: llama.cpp's "prompt eval" (all prompt tokens in one batch, after a warmup run that
    touches every expert, untimed); S-MoE's prefill_tok_s = prefilled tokens (the prompt but
    its last token) / time to first token. Uncapped, S-MoE loads every expert first
    (`--preload`, its preload_s reported apart, as llama.cpp's load and warmup are), so both
    sides are warm; --no-smoe-preload measures S-MoE cold instead (its reads then count).
  - decode: llama.cpp's "eval" (runs after the first token); S-MoE's decode_tok_s (tokens
    after the first / their time). llama.cpp ignores EOS (--ignore-eos); S-MoE has no such
    switch, so its generated_tokens is reported.
  - wall_s: the whole process, load and warmup included: the cold end-to-end cost.
  - other_cpu_share: the share of the machine's CPU that went to anything but the case's
    process while it ran. Both tools are CPU bound on few cores, and llama.cpp's spinning
    thread barriers suffer most from sharing them (here 20x slower decode beside a test run):
    run on a quiet machine, and distrust a case whose share is well above ~0.05.
Needs root and a memory controller (tests/cgroup.py); drops the page cache before each case.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness

from tests.cgroup import limited

REPO = harness.REPO

# ~44 tokens of the synthetic tokenizer (smoe/synth/tokenizer.py trains on this prose).
PROMPT = (
    "A mixture of experts model sends each token to a few of its many experts, so only a "
    "small part of the model runs for every token. The router scores all experts and keeps "
    "the best ones. It is fast."
)
LLAMA_VERSION = "0.3.36"  # the llama-cpp-python sdist this was first run with
LLAMA_TOOLS = ("llama-completion", "llama-quantize")
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # a local benchmark binary: this CPU's AVX2/FMA/F16C
    "-DGGML_CUDA=OFF",
    "-DLLAMA_CURL=OFF",  # older trees' download support (ignored by newer ones)
    "-DLLAMA_OPENSSL=OFF",  # newer trees' HTTPS support: nothing is downloaded
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # binaries that run from anywhere
]
# What convert_hf_to_gguf.py imports (gguf-py comes from the source tree). torch 2.13 is the
# CPU wheel the machine's package index holds; transformers as this checkout's.
CONVERT_PACKAGES = [
    "torch==2.13.0",
    "transformers==5.25.0",
    "numpy",
    "sentencepiece",
    "safetensors",
    "tokenizers",
    "pyyaml",
    "tqdm",
    "requests",
    "protobuf<5",
    "jinja2",
]
# convert_hf_to_gguf.py identifies a BPE pre-tokenizer by hashing its output on a test text;
# the synthetic tokenizer's hash is unknown to it. Its pre-tokenizer is ByteLevel with GPT-2's
# regex, which is llama.cpp's "gpt-2", so the wrapper falls back to that (and the benchmark
# checks the resulting token ids against the vault tokenizer's).
CONVERT_WRAPPER = """\
import runpy, sys
from pathlib import Path
src = Path(sys.argv[1])
sys.argv = [str(src / "convert_hf_to_gguf.py"), *sys.argv[2:]]
sys.path[:0] = [str(src), str(src / "gguf-py")]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("unknown BPE pre-tokenizer: using gpt-2's (ByteLevel, GPT-2 regex)", file=sys.stderr)
        return "gpt-2"
TextModel.get_vocab_base_pre = pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# Runs a command as its child and reports the child's peak RSS (the cgroup's peak also counts
# page cache, which for an mmapped GGUF is most of it) and CPU seconds on stderr.
RSS_WRAPPER = """\
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(f"MAX_RSS_BYTES {usage.ru_maxrss * 1024}", file=sys.stderr, flush=True)
print(f"CHILD_CPU_S {usage.ru_utime + usage.ru_stime}", file=sys.stderr, flush=True)
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""
SMOE_MAIN = "import sys\nfrom smoe.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def log(msg: str) -> None:
    print(f"[llama_cpp] {msg}", file=sys.stderr, flush=True)


def run(argv: list[Any], **kw: Any) -> subprocess.CompletedProcess:
    """Run a setup step, echoing it; fail loudly. Its output goes to stderr: stdout is the
    report's."""
    argv = [str(a) for a in argv]
    log("$ " + " ".join(argv))
    return subprocess.run(argv, check=True, stdout=sys.stderr, **kw)


# ---------------------------------------------------------------- llama.cpp: source, build


def llama_source(a: argparse.Namespace) -> Path:
    """vendor/llama.cpp of the sdist extracted in --llama-dir (downloaded if missing)."""
    found = sorted(a.llama_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    sdist = a.sdist
    if sdist is None:
        have = sorted((a.llama_dir / "sdist").glob("llama_cpp_python-*.tar.gz"))
        if not have:
            spec = f"llama-cpp-python=={a.llama_version}" if a.llama_version else "llama-cpp-python"
            run(
                [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
                + [spec, "-d", a.llama_dir / "sdist"]
            )
            have = sorted((a.llama_dir / "sdist").glob("llama_cpp_python-*.tar.gz"))
        sdist = have[-1]
    log(f"extracting {sdist}")
    with tarfile.open(sdist) as tar:
        tar.extractall(a.llama_dir, filter="data")
    found = sorted(a.llama_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise SystemExit(f"{sdist} has no vendor/llama.cpp")
    return found[-1]


def llama_build(a: argparse.Namespace) -> Path:
    """The folder of the built tools: reused if they are there, else cmake-built."""
    build = a.llama_dir / a.build_dir
    bindir = build / "bin"
    if not a.rebuild and all((bindir / t).exists() for t in LLAMA_TOOLS):
        return bindir
    src = llama_source(a)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", src, "-B", build, *gen, *CMAKE_FLAGS, *a.cmake_arg])
    run(["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target", *LLAMA_TOOLS])
    return bindir


def llama_version(bindir: Path) -> str | None:
    """llama-completion's own "version: ... (build N, commit X)" line."""
    out = subprocess.run(
        [bindir / "llama-completion", "--version"], capture_output=True, text=True, check=False
    )
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version:")]
    return lines[0].removeprefix("version:").strip() if lines else None


def convert_python(a: argparse.Namespace) -> Path:
    """The python of the venv convert_hf_to_gguf.py runs in (made on first use)."""
    py = a.llama_dir / "venv" / "bin" / "python"
    if not py.exists():
        # sys._base_executable: a venv made from inside this checkout's venv is still based on
        # the real interpreter, and gets none of this checkout's packages.
        base = getattr(sys, "_base_executable", sys.executable)
        run([base, "-m", "venv", a.llama_dir / "venv"])
        run([py, "-m", "pip", "install", "-q", *CONVERT_PACKAGES])
    return py


# ---------------------------------------------------------------- model files


@dataclass
class Models:
    source: Path
    gguf: Path
    vault: Path
    vault4: Path


def model_paths(a: argparse.Namespace) -> Models:
    stem = a.models / f"qwen3-30b-a3b-l{a.layers}"
    return Models(
        source=a.source or Path(f"{stem}-src"),
        gguf=a.gguf or Path(f"{stem}-q4_0.gguf"),
        vault=a.vault or Path(f"{stem}-vault"),
        vault4=a.vault4 or Path(f"{stem}-vault-bb4"),
    )


def smoe_cli(*args: Any) -> list[str]:
    """`smoe ARGS` with this checkout's smoe and this interpreter."""
    return [sys.executable, "-c", SMOE_MAIN, *map(str, args)]


def smoe_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def timed(phases: dict[str, float], name: str, fn: Any, *args: Any) -> Any:
    t = time.perf_counter()
    out = fn(*args)
    phases[name] = round(time.perf_counter() - t, 1)
    log(f"{name}: {phases[name]} s")
    return out


def make_source(a: argparse.Namespace, m: Models) -> None:
    run(
        smoe_cli("synth", "--preset", "qwen3-30b-a3b", "--layers", a.layers, m.source, "--quiet"),
        env=smoe_env(),
    )


def make_gguf(a: argparse.Namespace, m: Models, bindir: Path) -> None:
    """bf16 GGUF from the checkpoint, then Q4_0; the bf16 one (as big as the source) goes."""
    src = llama_source(a)
    py = convert_python(a)
    bf16 = m.gguf.with_name(m.gguf.stem + ".bf16.gguf")
    if not bf16.exists():
        tmp = bf16.with_name(bf16.name + ".part")  # a killed conversion leaves no "done" file
        run([py, "-c", CONVERT_WRAPPER, src, m.source, "--outtype", "bf16", "--outfile", tmp])
        tmp.rename(bf16)
    tmp = m.gguf.with_name(m.gguf.name + ".part")
    run([bindir / "llama-quantize", bf16, tmp, "Q4_0", str(a.threads)])
    tmp.rename(m.gguf)
    if not a.keep_bf16:
        bf16.unlink()


def make_vault(m: Models, vault: Path, backbone_bits: int | None) -> None:
    extra = ["--backbone-bits", str(backbone_bits)] if backbone_bits else []
    run(smoe_cli("convert", m.source, vault, *extra, "--quiet"), env=smoe_env())


def ensure_models(a: argparse.Namespace, m: Models, cases: list[Case], bindir: Path) -> dict:
    """Create the files the chosen cases need (with --create); return each phase's seconds."""
    needed = {c.model for c in cases} | {"gguf"}  # the cap is the GGUF's size / 3
    wanted = [k for k in ("gguf", "vault", "vault4") if k in needed]
    missing = [k for k in wanted if not getattr(m, k).exists()]
    if not missing:
        return {}
    if not a.create:
        paths = ", ".join(str(getattr(m, k)) for k in missing)
        raise SystemExit(f"missing {paths}: pass --create to make them (minutes each)")
    phases: dict[str, float] = {}
    if not m.source.exists():
        timed(phases, "synth_s", make_source, a, m)
    if "gguf" in missing:
        timed(phases, "gguf_s", make_gguf, a, m, bindir)
    if "vault" in missing:
        timed(phases, "vault_s", make_vault, m, m.vault, None)
    if "vault4" in missing:
        timed(phases, "vault4_s", make_vault, m, m.vault4, 4)
    return phases


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    name: str
    engine: str  # "llama" or "smoe"
    model: str  # the Models field it runs: gguf, vault or vault4
    capped: bool


CASES = {
    c.name: c
    for c in (
        Case("llama", "llama", "gguf", False),
        Case("smoe", "smoe", "vault", False),
        Case("smoe-bb4", "smoe", "vault4", False),
        Case("llama-cap", "llama", "gguf", True),
        Case("smoe-cap", "smoe", "vault", True),
        Case("smoe-bb4-cap", "smoe", "vault4", True),
    )
}


def prompt_ids(m: Models) -> list[int]:
    """The prompt's ids under the model's own tokenizer (the one S-MoE loads from its vault)."""
    from tokenizers import Tokenizer

    for folder in (m.vault, m.vault4, m.source):
        if (folder / "tokenizer.json").exists():
            return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids
    raise SystemExit("no tokenizer.json in the vaults or the source checkpoint")


def mem_total() -> int:
    """The machine's RAM: the "no cap" cases' cgroup limit (a group, to measure the peak)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no MemTotal in /proc/meminfo")


def cpu_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores; idle and iowait excluded)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cold_run(argv: list[str], limit: int, **kw: Any) -> tuple[subprocess.CompletedProcess, dict]:
    """``argv`` in a fresh memory cgroup of ``limit`` bytes after dropping the page cache:
    its result, and what it cost (wall time, peak memory, CPU)."""
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    busy, t = cpu_busy_s(), time.perf_counter()
    done = limited(
        [sys.executable, "-c", RSS_WRAPPER, *argv], limit, capture_output=True, text=True, **kw
    )
    wall, busy = time.perf_counter() - t, cpu_busy_s() - busy
    if done is None:
        raise SystemExit("cannot create a memory cgroup here (needs root and a memory controller)")
    rss = re.findall(r"MAX_RSS_BYTES (\d+)", done.result.stderr)
    cpu = [float(x) for x in re.findall(r"CHILD_CPU_S ([\d.]+)", done.result.stderr)]
    # Both tools are CPU bound on 2 cores: anything else running skews them. This is the share
    # of the machine's CPU the case's process did not use itself (other processes, and kernel
    # threads such as kswapd reclaiming under a cap); near 0 on a quiet machine.
    other = (busy - cpu[-1]) / (wall * (os.cpu_count() or 1)) if cpu else None
    return done.result, {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu[-1], 2) if cpu else None,
        "other_cpu_share": round(max(other, 0.0), 3) if other is not None else None,
        "cgroup_peak": done.peak,
        "max_rss": int(rss[-1]) if rss else None,
        "oom_kills": done.oom_kills,
    }


def failed(res: subprocess.CompletedProcess, cost: dict) -> dict[str, Any] | None:
    if res.returncode == 0:
        return None
    return {"exit": res.returncode, **cost, "error": res.stderr[-1500:]}


_PERF = {
    # common_perf_print: prompt eval time =  323.01 ms /  67 tokens (4.82 ms per token, 207.43 tokens per second)
    "prompt": re.compile(
        r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens.*?([\d.]+) tokens per second"
    ),
    "eval": re.compile(
        r"perf_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs.*?([\d.]+) tokens per second"
    ),
    "load": re.compile(r"load time =\s*([\d.]+) ms"),
}


def llama_case(a: argparse.Namespace, bindir: Path, m: Models, cap: int | None) -> dict:
    argv = [str(bindir / "llama-completion"), "-m", str(m.gguf), "-p", PROMPT]
    argv += ["-n", str(a.max_tokens), "--temp", "0", "--ignore-eos", "--seed", "0"]
    argv += ["-no-cnv", "-t", str(a.threads), "-tb", str(a.threads), "-c", str(a.max_context)]
    argv += ["--verbose-prompt"]  # prints the prompt's ids: checked against S-MoE's
    if cap is not None:
        argv += ["-nr"]
    argv += a.llama_args
    res, cost = cold_run(argv, cap or mem_total())
    if (bad := failed(res, cost)) is not None:
        return bad
    err = res.stderr
    prompt, evals, load = (_PERF[k].search(err) for k in ("prompt", "eval", "load"))
    if prompt is None or evals is None:
        return {"exit": 0, "error": "no timings in llama-completion's output: " + err[-1500:]}
    # The prompt's ids: "     43 -> 'I'" lines after "number of tokens in prompt".
    listed = err.split("number of tokens in prompt", 1)[-1].split("sampler seed", 1)[0]
    ids = [int(i) for i in re.findall(r"^\S+ I\s+(\d+) -> '", listed, re.M)]
    return {
        "prompt_tokens": int(prompt.group(2)),
        "prefill_tok_s": float(prompt.group(3)),
        "decode_runs": int(evals.group(2)),
        "decode_tok_s": float(evals.group(3)),
        "load_s": float(load.group(1)) / 1e3 if load else None,
        **cost,
        "prompt_ids": ids,
        "text": res.stdout[-400:],
    }


_shown_keys = False


def smoe_case(a: argparse.Namespace, vault: Path, ids: list[int], cap: int | None) -> dict:
    global _shown_keys
    argv = smoe_cli("generate", vault, "--prompt-ids", ",".join(map(str, ids)))
    argv += ["--max-tokens", str(a.max_tokens), "--temp", "0", "--json"]
    argv += ["--max-context", str(a.max_context)]
    memory = int(cap * a.memory_share) if cap is not None else None
    if memory is not None:
        argv += ["--memory", str(memory)]
    elif a.smoe_preload:  # no cap: load every expert first, as llama.cpp's warmup does
        argv += ["--preload"]
    res, cost = cold_run(argv, cap or mem_total(), env=smoe_env(), cwd=str(REPO))
    if (bad := failed(res, cost)) is not None:
        return bad
    out = json.loads(res.stdout.strip().splitlines()[-1])
    st = out["stats"]
    if not _shown_keys:  # what `smoe generate --json` reports, for whoever reads the log
        log("smoe stats keys: " + ", ".join(st))
        _shown_keys = True
    keep = ("prompt_tokens", "prefilled_tokens", "generated_tokens", "ttft_s", "preload_s")
    # How it computed (dtype, kernels, BLAS): the CPU kernels change under this benchmark.
    how = ("compute_dtype", "arithmetic", "cpu_blas")
    return {
        **{k: st.get(k) for k in keep},
        "prefill_tok_s": st.get("prefill_tok_s"),
        "decode_tok_s": st.get("decode_tok_s"),
        "bytes_read": st.get("bytes_read"),
        "memory": memory,
        **cost,
        "finish_reason": out.get("finish_reason"),
        **{k: st[k] for k in how if k in st},
        "text": out.get("text", "")[-400:],
    }


def run_case(
    a: argparse.Namespace, c: Case, bindir: Path, m: Models, ids: list[int], cap: int
) -> dict:
    limit = cap if c.capped else None
    if c.engine == "llama":
        return llama_case(a, bindir, m, limit)
    return smoe_case(a, getattr(m, c.model), ids, limit)


# ---------------------------------------------------------------- summary


def median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    keys = ("prefill_tok_s", "decode_tok_s", "cgroup_peak", "max_rss", "wall_s", "other_cpu_share")
    return {name: {k: median(rs, k) for k in keys} for name, rs in runs.items()}


def ratios(summary: dict[str, dict]) -> dict[str, dict]:
    """Each S-MoE case over the llama.cpp case of the same cap (above 1: S-MoE's is higher)."""
    out = {}
    for name, s in summary.items():
        if not name.startswith("smoe"):
            continue
        ref = summary.get("llama-cap" if name.endswith("-cap") else "llama")
        if ref is None:
            continue
        out[name] = {
            k: round(s[k] / ref[k], 4) if s.get(k) and ref.get(k) else None
            for k in ("prefill_tok_s", "decode_tok_s", "cgroup_peak", "max_rss", "wall_s")
        }
    return out


# ---------------------------------------------------------------- main


def parse() -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument(
        "--llama-dir",
        type=Path,
        default=Path("/work/llama"),
        help="where llama.cpp's sdist, source, build and convert venv live (default %(default)s)",
    )
    p.add_argument(
        "--sdist", type=Path, help="a llama-cpp-python sdist .tar.gz (default: pip download)"
    )
    p.add_argument(
        "--llama-version",
        default=LLAMA_VERSION,
        help="the llama-cpp-python version pip downloads (default %(default)s; '' for the newest)",
    )
    p.add_argument(
        "--rebuild", action="store_true", help="rebuild llama.cpp even if its tools exist"
    )
    p.add_argument(
        "--build-dir",
        default="build",
        help="llama.cpp's build folder inside --llama-dir (default %(default)s)",
    )
    p.add_argument(
        "--cmake-arg",
        action="append",
        default=[],
        help="one more cmake -D setting, after ours (repeatable), e.g. "
        "--cmake-arg=-DGGML_NATIVE=OFF --cmake-arg=-DGGML_AVX2=ON",
    )
    p.add_argument(
        "--models",
        type=Path,
        default=Path("/work/models"),
        help="where the model files are (default %(default)s)",
    )
    p.add_argument(
        "--layers", type=int, default=18, help="the synthetic model's layers (default %(default)s)"
    )
    p.add_argument(
        "--source", type=Path, help="the HF checkpoint (default MODELS/qwen3-30b-a3b-lL-src)"
    )
    p.add_argument(
        "--gguf", type=Path, help="the Q4_0 GGUF (default MODELS/qwen3-30b-a3b-lL-q4_0.gguf)"
    )
    p.add_argument(
        "--vault", type=Path, help="S-MoE vault, float backbone (default MODELS/...-vault)"
    )
    p.add_argument(
        "--vault4", type=Path, help="S-MoE vault, 4-bit backbone (default MODELS/...-vault-bb4)"
    )
    p.add_argument("--create", action="store_true", help="make missing model files (minutes each)")
    p.add_argument("--keep-bf16", action="store_true", help="keep the bf16 GGUF quantize reads")
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help="comma-separated, from: " + ", ".join(CASES) + " (default: all)",
    )
    harness.rounds(p, default=1)
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens generated (default %(default)s)"
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=512,
        help="context both sides budget their KV cache for (default %(default)s)",
    )
    p.add_argument(
        "--threads", type=int, default=2, help="llama.cpp's threads (default %(default)s)"
    )
    p.add_argument(
        "--memory-share",
        type=float,
        default=0.92,
        help="S-MoE's --memory under a cap, as a share of the cap (default %(default)s)",
    )
    p.add_argument(
        "--no-smoe-preload",
        dest="smoe_preload",
        action="store_false",
        help="uncapped S-MoE cases read experts on first use (cold) instead of loading them "
        "all first as llama.cpp does (default: load first, --preload)",
    )
    p.add_argument(
        "--llama-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="more llama-completion arguments, e.g. --no-warmup (must come last)",
    )
    a = p.parse_args()
    a.llama_dir = a.llama_dir.resolve()
    return a


def main() -> None:
    a = parse()
    unknown = [n for n in a.cases.split(",") if n and n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    cases = [CASES[n] for n in a.cases.split(",") if n]
    m = model_paths(a)
    setup: dict[str, float] = {}
    bindir = timed(setup, "llama_build_s", llama_build, a)
    setup |= ensure_models(a, m, cases, bindir)
    cap = m.gguf.stat().st_size // 3
    ids = prompt_ids(m)
    log(f"prompt: {len(ids)} tokens; cap {cap / 1e9:.2f} GB (the GGUF's bytes / 3)")

    runs: dict[str, list[dict]] = {c.name: [] for c in cases}
    for i in range(a.rounds):
        # Alternate the order round by round, so no case always follows the same one.
        for c in cases if i % 2 == 0 else cases[::-1]:
            log(f"round {i + 1}/{a.rounds}: {c.name}")
            r = run_case(a, c, bindir, m, ids, cap)
            runs[c.name].append(r)
            brief = {k: v for k, v in r.items() if k not in ("text", "prompt_ids", "error")}
            log(
                f"{c.name}: {json.dumps(brief)}"
                + (f" error: {r['error'][-600:]}" if "error" in r else "")
            )
            if (r.get("other_cpu_share") or 0) > 0.1:
                log(
                    f"warning: {r['other_cpu_share']:.0%} of the CPU went elsewhere during {c.name}"
                )

    # llama.cpp tokenizes the text itself: do its ids match the ones S-MoE was given?
    seen = [
        r["prompt_ids"]
        for c in cases
        if c.engine == "llama"
        for r in runs[c.name]
        if "prompt_ids" in r
    ]
    match = all(s == ids for s in seen) if seen else None
    for rs in runs.values():
        for r in rs:
            r.pop("prompt_ids", None)
    summary = summarize(runs)
    harness.report(
        {
            "benchmark": "llama_cpp",
            "llama_cpp": {
                "version": llama_version(bindir),
                "source": str(max(a.llama_dir.glob("llama_cpp_python-*"), default="")) or None,
                "bin": str(bindir),
            },
            "models": {k: str(v) for k, v in vars(m).items()},
            "gguf_bytes": m.gguf.stat().st_size,
            "cap": cap,
            "layers": a.layers,
            "prompt": PROMPT,
            "prompt_ids": ids,
            "prompt_ids_match": match,
            "prompt_note": "llama-completion takes text, not ids: S-MoE gets the vault "
            "tokenizer's ids, llama.cpp the text; prompt_ids_match compares llama.cpp's own "
            "tokenization (--verbose-prompt) with them",
            "max_tokens": a.max_tokens,
            "max_context": a.max_context,
            "threads_llama": a.threads,
            "llama_args": a.llama_args,
            "memory_share": a.memory_share,
            "rounds": a.rounds,
            "setup_s": setup,
            "runs": runs,
            "median": summary,
            "ratio_smoe_over_llama": ratios(summary),
        },
        a,
    )


if __name__ == "__main__":
    main()
