"""Serving under concurrent load: ``dtorch serve`` against llama.cpp's server, side by side in one run.

    python bench/serve.py [--servers dtorch,llamacpp] [--model PATH.gguf] [--clients 1,4,16]
                          [--requests-per-client 2] [--max-tokens 64] [--repeats 1] [--threads N]
                          [--llamacpp-python PATH] [--smoke]

Each server runs as a subprocess on a free 127.0.0.1 port and gets one warm-up request; then, for each level of
``--clients``, that many threads each send ``--requests-per-client`` streaming chat completions one after another
through the official ``openai`` client. The prompts are made from ``--seed``: an instruction plus 0 to 22 filler
sentences (roughly 20 to 400 tokens), spread evenly over that range in the order they are sent, each opened by a
unique request tag so no server can reuse an earlier prompt's cache. Greedy, ``--max-tokens`` new tokens, the
end-of-sequence token held off (``ignore_eos`` for dtorch, a ``logit_bias`` of -1e4 on the GGUF's eos/eot ids for
llama.cpp), so both make the same number of tokens; "tok/req" shows what they made.
- llama.cpp: ``python -m llama_cpp.server`` (llama-cpp-python with its server extras) run by the Python of
  ``--llamacpp-python`` (default ``$LLAMACPP_PYTHON`` or ``/work/venv-llamacpp/bin/python``); it serves one
  request at a time. ``--interrupt_requests False`` (its default, True, ends a stream early when the next request
  arrives) and ``--logits_all False`` (its default computes logits for every prompt token); otherwise its defaults.
- dtorch: ``python -m dtorch serve``; ``dtorch-tp2`` with ``-tp 2`` in one process, ``dtorch-ranks2`` the same split
  on 2 gloo ranks under torchrun (rank 0 serving, each step's plan broadcast): ``--servers dtorch-tp2,dtorch-ranks2
  --clients 1`` gives their ratio for one stream (target >= 0.9x).
Per level: "out tok/s" is all completion tokens (the server's usage count where it sends one, else content
chunks) over the level's wall time; TTFT is send to first content chunk; ITL the gaps between content chunks.
With ``--repeats`` > 1 every number is the median over the repeats.
``--smoke`` (what CI runs): clients 1 and 2, one request each of at most 2 filler sentences (``--max-filler``), 8
new tokens; a server that fails fails the run (llama.cpp's is skipped, and says so, where its Python is absent).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_LLAMACPP = "/work/venv-llamacpp/bin/python"
LLAMACPP_PIP = ("pip install 'uvicorn>=0.22.0' 'fastapi>=0.100.0' 'pydantic-settings>=2.0.1' 'sse-starlette>=1.6.1' "
                "'starlette-context>=0.3.6,<0.4' 'PyYAML>=5.1'")
MAX_FILLER = 22  # filler sentences in the longest prompt: ~400 tokens with the instruction and chat template
TARGET_SCALING, TARGET_VS_LLAMACPP = 3.0, 1.0  # dtorch tok/s at 16 clients / at 1; dtorch / llama.cpp at 16
TARGET_RANKS = 0.9  # one stream served across 2 gloo ranks / the same tp=2 split in one process (#41)
KINDS = ("dtorch", "llamacpp", "dtorch-tp2", "dtorch-ranks2")

INSTRUCTIONS = [
    "Summarize the following notes in one short paragraph.",
    "Write a short story that begins with the text below.",
    "List three questions a careful reader might ask about this passage.",
    "Explain the passage below to a ten-year-old.",
    "Translate the main idea of these notes into plain English.",
    "Continue the text below in the same style.",
    "Give a title and a one-line summary for the following text.",
    "Describe the setting of the passage below in detail.",
]
FILLER = [
    "The river ran slowly past the old mill, carrying leaves from the hills in the north.",
    "Every morning the baker opened her shop before sunrise and lit the large stone oven.",
    "A small group of students met in the library to argue about the history of the town.",
    "The train from the capital was late again, and the platform filled with tired travellers.",
    "In the garden behind the school, the children planted tomatoes, beans and yellow flowers.",
    "The old lighthouse keeper wrote a letter each week to his sister who lived across the sea.",
    "Heavy clouds gathered over the valley while the farmers hurried to bring in the hay.",
    "At the market square, a musician played the violin for anyone who would stop and listen.",
]


def prompt(seed: int, index: int, tag: str, max_filler: int = MAX_FILLER) -> str:
    """The ``index``-th prompt of the seeded list: ``index`` * the golden ratio (mod 1) sets its filler count (0 to
    ``max_filler``), so any run of consecutive indices covers short and long prompts alike."""
    rng = random.Random(seed * 1_000_003 + index)
    n = round(((index * 0.6180339887 + seed * 0.1) % 1.0) * max_filler)
    body = " ".join(rng.choice(FILLER) for _ in range(n))
    return f"[{tag}] {rng.choice(INSTRUCTIONS)}\n\n{body}".rstrip()


# ---- servers -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Server:
    """How to start one server and what each of its requests adds to the body to keep it generating."""

    name: str
    argv: list[str]
    extra_body: dict = field(default_factory=dict)
    env: dict | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eos_ids(model: str) -> list[int]:
    """The GGUF's end-of-sequence token ids (``tokenizer.ggml.eos_token_id`` and ``eot_token_id``)."""
    import gguf

    fields = gguf.GGUFReader(model).fields
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    return sorted({int(fields[k].contents()) for k in keys if k in fields})


def dtorch_server(args: argparse.Namespace, port: int, kind: str = "dtorch") -> Server:
    """``dtorch serve``; kind "dtorch-tp2": ``-tp 2`` in one process (cpu:0 and cpu:1, ``--threads`` shared);
    "dtorch-ranks2": ``-tp 2`` under torchrun, 2 gloo ranks of half the threads each (the same split)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    serve = ["serve", "--host", "127.0.0.1", "--port", str(port), "--model", args.model]
    if kind == "dtorch-ranks2":
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), "-m", "dtorch", *serve, "-tp", "2", "--threads", str(max(1, args.threads // 2))]
    else:
        argv = [sys.executable, "-m", "dtorch", *serve, "--threads", str(args.threads)]
        if kind == "dtorch-tp2":
            argv += ["-tp", "2"]
    return Server(kind, argv, {"ignore_eos": True}, env)


def llamacpp_python(arg: str | None) -> tuple[str | None, str]:
    """(the Python that can run ``llama_cpp.server``, "") or (None, why not)."""
    candidate = arg or os.environ.get("LLAMACPP_PYTHON") or DEFAULT_LLAMACPP
    if not os.path.exists(candidate):
        return None, f"{candidate} does not exist (build it with ../shared/tools/llamacpp-venv.sh)"
    proc = subprocess.run([candidate, "-c", "import llama_cpp.server.app"], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{candidate} cannot import llama_cpp.server ({last}); install its extras: {LLAMACPP_PIP}"
    return candidate, ""


def llamacpp_server(args: argparse.Namespace, port: int, python: str) -> Server:
    n_ctx = max(2048, 640 + args.max_tokens)  # the longest prompt (~400 tokens) plus the new tokens
    argv = [python, "-m", "llama_cpp.server", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(n_ctx), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
            "--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"]
    return Server("llama.cpp", argv, {"logit_bias": {str(i): -1e4 for i in eos_ids(args.model)}})


class Running:
    """A started server process; ``stop()`` sends SIGTERM, waits 15 s, then kills it."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-serve-{server.name}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(server.argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=server.env, cwd=REPO)

    def log_tail(self, n: int = 15) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def wait_ready(self, base_url: str, timeout: float) -> str:
        """Poll GET /v1/models until it answers; return the first model id. Raises RuntimeError on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.name} exited with {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{base_url}/models", timeout=5) as r:
                    return json.load(r)["data"][0]["id"]
            except (OSError, ValueError, KeyError, IndexError):
                time.sleep(0.5)
        raise RuntimeError(f"{self.server.name} did not answer GET {base_url}/models within {timeout:.0f} s "
                           f"(raise --startup-timeout):\n{self.log_tail()}")

    def stop(self, ok: bool) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self.log.close()
        if ok:
            os.unlink(self.log.name)
        else:
            print(f"  (server log kept in {self.log.name})", file=sys.stderr)


# ---- load ----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Record:
    """One request: seconds to the first content chunk, seconds between content chunks, tokens made."""

    ttft: float
    itls: list[float]
    tokens: int


def one_request(client, model: str, text: str, max_tokens: int, extra_body: dict, timeout: float) -> Record:
    t0 = time.perf_counter()
    deadline = t0 + timeout
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], stream=True, temperature=0.0,
        max_tokens=max_tokens, stream_options={"include_usage": True}, extra_body=extra_body or None)
    times, usage = [], None
    with stream:
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(now)
            if now > deadline:
                raise TimeoutError(f"request still streaming after {timeout:.0f} s (raise --request-timeout)")
    if not times:
        raise RuntimeError("the stream ended without any content")
    return Record(times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)], usage or len(times))


def client_for(base_url: str, timeout: float):
    import openai

    return openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=timeout)


def run_level(base_url: str, model: str, clients: int, args: argparse.Namespace, extra_body: dict,
              tag: str) -> tuple[list[Record], list[str], float]:
    """``clients`` threads, each sending ``args.requests_per_client`` requests in turn: (records, errors, wall s).

    Request j of client i is prompt j * clients + i, so each wave of concurrent requests covers the length range."""
    def client_run(i: int) -> tuple[list[Record], list[str]]:
        client, records, errors = client_for(base_url, args.request_timeout), [], []
        for j in range(args.requests_per_client):
            k = j * clients + i
            try:
                records.append(one_request(client, model, prompt(args.seed, k, f"{tag} request {k}", args.max_filler),
                                           args.max_tokens, extra_body, args.request_timeout))
            except Exception as e:  # a failed request is counted and reported, the level goes on
                errors.append(f"{type(e).__name__}: {e}"[:200])
        client.close()
        return records, errors

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(client_run, range(clients)))
    wall = time.perf_counter() - t0
    return [r for rs, _ in results for r in rs], [e for _, es in results for e in es], wall


def pct(xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``xs``; nan when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def level_stats(records: list[Record], errors: list[str], wall: float, sent: int) -> dict:
    tokens = sum(r.tokens for r in records)
    ttft, itl = [r.ttft * 1e3 for r in records], [g * 1e3 for r in records for g in r.itls]
    return {"ok": len(records), "sent": sent, "tok_req": tokens / len(records) if records else math.nan,
            "tps": tokens / wall, "ttft50": pct(ttft, 0.5), "ttft99": pct(ttft, 0.99), "itl50": pct(itl, 0.5),
            "itl99": pct(itl, 0.99), "errors": errors}


def bench_server(server: Server, port: int, args: argparse.Namespace, levels: list[int]) -> dict[int, dict]:
    """Start ``server``, warm it up, run every level ``args.repeats`` times: {clients: median stats}."""
    import openai

    base_url = f"http://127.0.0.1:{port}/v1"
    print(f"{server.name}: starting on 127.0.0.1:{port} ...", file=sys.stderr, flush=True)
    run, ok = Running(server), False
    try:
        model = run.wait_ready(base_url, args.startup_timeout)
        extra = server.extra_body
        client = client_for(base_url, args.request_timeout)
        try:
            one_request(client, model, prompt(args.seed, 0, "warm-up", args.max_filler), 8, extra, args.request_timeout)
        except openai.APIStatusError as e:  # 400 or 422: the server does not take the length-forcing fields
            if not extra or e.status_code not in (400, 422):
                raise
            print(f"  {server.name} refused {sorted(extra)} ({str(e)[:120]}); sending without it, so the output "
                  "lengths are not forced (see tok/req)", file=sys.stderr)
            extra = {}
            one_request(client, model, prompt(args.seed, 0, "warm-up", args.max_filler), 8, extra, args.request_timeout)
        client.close()
        out = {}
        for c in levels:
            runs = []
            for r in range(args.repeats):
                records, errors, wall = run_level(base_url, model, c, args, extra, f"{c} clients, run {r}")
                runs.append(level_stats(records, errors, wall, c * args.requests_per_client))
                print(f"  {server.name} {c} clients run {r}: {runs[-1]['tps']:.1f} tok/s, "
                      f"{len(errors)} errors", file=sys.stderr, flush=True)
                for e in errors[:3]:
                    print(f"    {e}", file=sys.stderr)
            out[c] = {k: statistics.median(s[k] for s in runs) for k in runs[0] if k != "errors"}
            out[c]["errors"] = sum(len(s["errors"]) for s in runs)
        ok = True
        return out
    finally:
        run.stop(ok)


# ---- report --------------------------------------------------------------------------------------------------


def fmt(v: object) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.1f}"
    return str(v)


def report(results: dict[str, dict[int, dict]], levels: list[int]) -> None:
    head = ["server", "clients", "ok/sent", "tok/req", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms"]
    rows = [[name, c, f"{s['ok']:g}/{s['sent']:g}", s["tok_req"], s["tps"], s["ttft50"], s["ttft99"], s["itl50"],
             s["itl99"]] for name, by in results.items() for c, s in by.items()]
    cells = [head] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    d, ref = results.get("dtorch"), results.get("llama.cpp")
    print()
    if d and len(levels) > 1:
        lo, hi = levels[0], levels[-1]
        target = f" (target >= {TARGET_SCALING:g}x)" if (lo, hi) == (1, 16) else ""
        print(f"dtorch scaling: out tok/s at {hi} clients / at {lo}: {d[hi]['tps'] / d[lo]['tps']:.2f}x{target}")
    if d and ref:
        for c in levels:
            target = f" (target > {TARGET_VS_LLAMACPP:g})" if c == 16 else ""
            print(f"dtorch / llama.cpp out tok/s at {c} clients: {d[c]['tps'] / ref[c]['tps']:.2f}x{target}")
    one, ranks = results.get("dtorch-tp2"), results.get("dtorch-ranks2")
    if one and ranks:
        c = levels[0]
        print(f"served across 2 gloo ranks / tp=2 in one process, out tok/s at {c} client(s): "
              f"{ranks[c]['tps'] / one[c]['tps']:.2f}x" + (f" (target >= {TARGET_RANKS:g}x)" if c == 1 else ""))
    print("Shared, noisy machine: quote medians of --repeats >= 3 for decisions.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="dtorch,llamacpp",
                    help="comma-separated: dtorch, llamacpp, dtorch-tp2 (-tp 2 in one process), dtorch-ranks2 "
                         "(-tp 2 on 2 gloo ranks under torchrun)")
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--clients", default="1,4,16", help="comma-separated concurrency levels")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="passed to both servers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llamacpp-python", default=None)
    ap.add_argument("--startup-timeout", type=float, default=120.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--max-filler", type=int, default=MAX_FILLER, help="filler sentences in the longest prompt")
    ap.add_argument("--smoke", action="store_true", help="clients 1,2, one short request each, 8 new tokens (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.requests_per_client, args.max_tokens, args.repeats = "1,2", 1, 8, 1
        args.max_filler = 2
        args.request_timeout = 120.0
    levels = sorted({int(c) for c in args.clients.split(",")})
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(names) - set(KINDS)
    if unknown or not levels or min(levels) < 1 or args.requests_per_client < 1 or args.repeats < 1:
        ap.error(f"--servers takes {', '.join(KINDS)} (got {sorted(unknown)}); --clients, "
                 "--requests-per-client and --repeats must be >= 1")
    if args.model is None:
        from dtorch.models.default import default_model_path
        args.model = str(default_model_path())

    print(f"model {os.path.basename(args.model)}; {args.threads} threads; clients {levels}, "
          f"{args.requests_per_client} streaming requests each; greedy, {args.max_tokens} new tokens; "
          f"prompts of 0-{args.max_filler} filler sentences (seed {args.seed}); "
          f"median of {args.repeats} run(s) after a warm-up", flush=True)
    results: dict[str, dict[int, dict]] = {}
    failed = []
    for name in names:
        port = free_port()
        if name == "llamacpp":
            python, why = llamacpp_python(args.llamacpp_python)
            if python is None:
                print(f"llama.cpp: skipped: {why}")
                continue
            server = llamacpp_server(args, port, python)
        else:
            server = dtorch_server(args, port, name)
        try:
            results[server.name] = bench_server(server, port, args, levels)
        except Exception as e:
            print(f"{server.name}: failed: {type(e).__name__}: {e}")
            failed.append(server.name)
    if results:
        print()
        report(results, levels)
    if args.smoke and failed:
        sys.exit(f"serve bench: {', '.join(failed)} failed (above)")


if __name__ == "__main__":
    main()
