"""``dtorch serve``: load a model and serve it over OpenAI's HTTP API until SIGTERM or Ctrl-C.

On SIGTERM the server stops accepting connections, lets requests in flight finish for up to ``--shutdown-grace``
seconds, aborts the rest, stops the engine's thread and exits 0.

Facing a network: ``--api-key`` (or DTORCH_API_KEY) makes every request but /health and /metrics carry
``Authorization: Bearer KEY`` (else 401); ``--allowed-origins`` lets browsers of those origins call it (CORS);
bodies past ``--max-body-bytes`` get 413, headers past ``--max-header-bytes`` 431, a request that does not arrive
whole within ``--request-timeout`` seconds 408, a connection past ``--max-connections`` 503; idle connections close
after ``--keep-alive-timeout`` seconds, and a log line that repeats is written a few times with its count. Once it
listens it prints a banner (the model, its weights' formats, the memory it holds, the threads, the URL with the real
port); each request logs one line at info level, and while the engine works a throughput line comes every
``--log-stats-interval`` seconds.

Under ``torchrun`` (``torchrun --nproc-per-node N [--nnodes M ...] -m dtorch serve -tp N``, or with ``-pp``), rank 0
runs the HTTP server and the engine, and every other rank follows it (``dtorch.engine.ranks``): each step's plan goes
to every rank, which runs the same step graph. A rank lost (dead, or silent past ``--rank-timeout`` seconds) turns
/health to 503 and ends the requests in flight with an error; then every rank exits 2 naming it. SIGTERM (or Ctrl-C)
on rank 0 drains as in one process, then tells every rank to stop: they all exit 0. The other ranks ignore SIGTERM and
SIGINT (torchrun sends them to every rank) and wait for rank 0's stop.

It answers as soon as the model is loaded: the step shapes a request needs are built when first used, and every other
shape the scheduler can make is built between requests (``Engine.start_warmup``); ``/health`` answers 200
``{"status": "warming", ...}`` until they all are, then ``{"status": "ok"}`` (503 once shutting down).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dtorch.core import env
from dtorch.core.errors import DtorchError
from dtorch.engine.options import add_model_arguments, add_pipeline_arguments, at_least, load_llm

MAX_BODY_BYTES = 16 << 20  # request bodies at most (build_app's default too); a prompt past the context is refused
MAX_HEADER_BYTES = 16 << 10  # h11's default
REQUEST_TIMEOUT_S = 60.0  # a request's head and body arrive within this (a 16 MiB body at ~300 KiB/s)
KEEP_ALIVE_S = 5.0  # uvicorn's default


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dtorch serve``."""
    add_model_arguments(parser)
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model's name in the API (default: the model file's or directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on (0: any free one)")
    parser.add_argument("-tp", "--tensor-parallel-size", type=at_least(1), default=1, metavar="N",
                        help="devices of this process to split the model over")
    add_pipeline_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="sequences in a batch at most")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens in a step at most")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="context length in tokens (default: the model's)")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="queued requests at most; more are answered 503")
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    parser.add_argument("--shutdown-grace", type=float, default=10.0, metavar="S",
                        help="on SIGTERM, seconds that requests in flight get to finish before they are aborted")
    parser.add_argument("--embedding-pooling", choices=["last", "mean"], default="last",
                        help="how /v1/embeddings pools the final hidden states: the last token's (decoder models' "
                             "usual choice) or the mean over the input")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="the log level of dtorch's lines (one per request at info) and uvicorn's")
    parser.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                        help="seconds between throughput lines while the engine works (0: none)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="the key clients must send as 'Authorization: Bearer KEY' (default: DTORCH_API_KEY; "
                             "none: no key); /health and /metrics stay open")
    parser.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                        help="comma-separated origins whose browser pages may call the API (CORS), e.g. "
                             "'http://localhost:3000'; '*' for any (default: none)")
    parser.add_argument("--max-body-bytes", type=at_least(1), default=MAX_BODY_BYTES, metavar="N",
                        help="request bodies at most, in bytes; a larger one gets 413")
    parser.add_argument("--max-header-bytes", type=at_least(1024), default=MAX_HEADER_BYTES, metavar="N",
                        help="a request's header at most, in bytes; a larger one gets 431")
    parser.add_argument("--max-connections", type=at_least(1), default=None, metavar="N",
                        help="open connections at most; a new one past them gets 503 and is closed (default: the "
                             "open-file limit, raised to its hard limit, less 64)")
    parser.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S, metavar="S",
                        help="seconds a request may take to arrive whole (head and body) from its first byte; a "
                             "slower one gets 408 and its connection is closed")
    parser.add_argument("--keep-alive-timeout", type=float, default=KEEP_ALIVE_S, metavar="S",
                        help="seconds an idle connection is kept open between requests")
    parser.add_argument("--rank-timeout", type=float, default=30.0, metavar="S",
                        help="under torchrun: seconds a rank may miss the liveness check (every second) before it is "
                             "taken as lost, /health answers 503 and every rank exits")


def served_name(source: str | Path) -> str:
    """A model's default name in the API: its file's name without the suffix, or its directory's name."""
    p = Path(source)
    return p.stem if p.is_file() else p.name


def warmup_bar(shapes: list) -> Iterable:
    """``shapes`` with a tqdm bar on stderr while they are built, when stderr is a terminal (else quiet)."""
    if not sys.stderr.isatty():
        return shapes
    from tqdm import tqdm

    return tqdm(shapes, desc="warming up", unit="shape", leave=False, file=sys.stderr)


def listening_url(server: Any, host: str) -> str:
    """The API's URL of a started uvicorn server, with the port it really bound (``--port 0``: the one it got)."""
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGTERM / Ctrl-C, shut down gracefully; returns the exit code."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise DtorchError(f"dtorch serve needs fastapi, uvicorn and prometheus_client ({exc}); "
                          "install them with: pip install 'dtorch[serve]'") from None

    from dtorch.serve.logs import setup_logging

    if not 0 <= args.port <= 65535:
        raise DtorchError(f"--port must be in 0..65535, got {args.port}")
    if args.shutdown_grace < 0:
        raise DtorchError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    for flag, value in (("--request-timeout", args.request_timeout), ("--keep-alive-timeout", args.keep_alive_timeout)):
        if not 0 < value < float("inf"):
            raise DtorchError(f"{flag} must be a number of seconds > 0, got {value}")
    if not 0 <= args.log_stats_interval < float("inf"):
        raise DtorchError(f"--log-stats-interval must be a number of seconds >= 0, got {args.log_stats_interval}")
    if not 1 <= args.rank_timeout < float("inf"):
        raise DtorchError(f"--rank-timeout must be a number of seconds >= 1, got {args.rank_timeout}")
    key = args.api_key if args.api_key is not None else env.api_key()
    if key is not None and not key.strip():
        raise DtorchError("--api-key is empty; give a key, or leave the option out to serve without one")
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    setup_logging(args.log_level)
    t0 = time.perf_counter()
    llm = load_llm(args, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                   max_waiting=args.max_waiting, tensor_parallel_size=args.tensor_parallel_size,
                   pipeline_parallel_size=args.pipeline_parallel_size, pp_layers=args.pp_layers)
    try:
        ranks = _join_ranks(llm, args)
        if ranks is not None and llm.rank != 0:
            return _follow(ranks)
        return _serve(llm, args, ranks, t0, key, origins)
    finally:
        llm.close()
        _leave_process_group()


def _join_ranks(llm: Any, args: argparse.Namespace) -> Any:
    """Under torchrun, this rank's ``Ranks`` (rank 0 also leads: its executor and cache tell the others each call);
    None in one process. What cannot be served across ranks is refused here, before any request."""
    from dtorch.distributed.torchdist import TorchDistCommunicator
    from dtorch.engine.ranks import Leader, Ranks

    if not isinstance(llm.executor.comm, TorchDistCommunicator):
        return None

    spec = llm.engine.speculator
    if spec is not None and llm.cache.has_state:
        raise DtorchError("dtorch serve: speculative decoding on a model with gated delta net layers is not served "
                          "across ranks (its state rollback is not told to the other ranks); drop "
                          "--speculative-config, or serve in one process")
    ranks = Ranks(llm, args.rank_timeout)
    if llm.rank == 0:
        ranks.leader = Leader(ranks)
    return ranks


def _follow(ranks: Any) -> int:
    """A rank other than 0: make the calls rank 0 tells until it says stop; SIGTERM / SIGINT wait for that stop."""
    from dtorch.engine.ranks import follow

    log = logging.getLogger("dtorch.serve")

    def wait_for_rank_0(sig: int, _frame: Any) -> None:
        log.info("rank %d: %s: waiting for rank 0's stop", ranks.rank, signal.Signals(sig).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, wait_for_rank_0)
    return follow(ranks)


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _serve(llm: Any, args: argparse.Namespace, ranks: Any, t0: float, key: str | None,
           origins: tuple[str, ...]) -> int:
    """Rank 0 (or the one process): the HTTP server on a thread, the engine on this one, until SIGTERM / Ctrl-C."""
    import uvicorn

    from dtorch.engine.loop import EngineLoop
    from dtorch.engine.ranks import NAMING_S
    from dtorch.serve.app import build_app
    from dtorch.serve.guard import default_max_connections, http_protocol
    from dtorch.serve.logs import banner, hold_back_repeats

    log = logging.getLogger("dtorch.serve")

    def on_error(exc: BaseException) -> None:
        if ranks is None or ranks.lost is None:  # a lost rank was said once (the steps after it fail alike)
            log.error("engine step failed", exc_info=exc)

    loop = EngineLoop(llm.engine, on_error=on_error)
    name = args.served_model_name or served_name(llm.source)
    loaded = time.perf_counter() - t0
    # the step shapes are built by the engine loop between requests (a request's own shapes when it needs them):
    # the server answers from the start, and /health says "warming" until every shape is built
    llm.engine.start_warmup()
    app = build_app(llm, name, engine_loop=loop, pooling=args.embedding_pooling, api_key=key,
                    allowed_origins=origins, max_body_bytes=args.max_body_bytes, log_interval=args.log_stats_interval)
    if ranks is not None:
        ranks.on_lost = app.state.server.lose
        if ranks.lost is not None:  # before the server existed
            app.state.server.lose(ranks.lost)
    # uvicorn's own limit is a backstop: the engine ends what is left at --shutdown-grace
    connections = args.max_connections or default_max_connections()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_grace + 5,
                            http=http_protocol(connections, args.request_timeout),
                            h11_max_incomplete_event_size=args.max_header_bytes,
                            timeout_keep_alive=args.keep_alive_timeout)
    hold_back_repeats("uvicorn", "uvicorn.error", "uvicorn.access")  # their handlers, set up by the Config
    server = uvicorn.Server(config)
    # HTTP on a thread of its own; the engine steps on this one, which loaded the model (see EngineLoop)
    http = threading.Thread(target=server.run, name="dtorch-http", daemon=True)

    stopping = threading.Event()

    def close_http() -> None:
        # torchrun sends SIGTERM to every rank as soon as one dies: the listener stays open (answering 503) until
        # the watchdog has had the time to name a lost rank; if it does, the lost rank's exit (status 2, after
        # ranks.LINGER_S of 503s) comes instead of the drain's
        if ranks is not None and ranks.lost_within(NAMING_S):
            return
        server.should_exit = True

    def shut_down(_sig: int, _frame: Any) -> None:  # SIGTERM / Ctrl-C, on this thread between steps
        if not stopping.is_set():  # new requests get 503 at once, those in flight get the grace, then abort
            stopping.set()
            threading.Thread(target=loop.stop, args=(args.shutdown_grace,), name="dtorch-shutdown",
                             daemon=True).start()
            threading.Thread(target=close_http, name="dtorch-close-http", daemon=True).start()
        elif ranks is None or ranks.lost is None:  # a second signal: close at once
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, shut_down)
    announced, warm = False, False

    def until() -> bool:  # between engine steps: the banner once the server listens; the end once HTTP is gone
        nonlocal announced, warm
        if not announced and server.started:
            announced = True
            listening = time.perf_counter() - t0
            print(banner(llm, name, listening_url(server, args.host), loaded, listening,
                         ranks.infos if ranks is not None else None), file=sys.stderr, flush=True)
        if not warm and llm.engine.warm:
            warm = True
            log.info("%d step shapes built, %.1f s after the start: /health says ok", llm.engine.warm_total,
                     time.perf_counter() - t0)
        return not http.is_alive()

    http.start()
    loop.run(until=until)  # ends when stopped, or when the server could not start
    http.join(args.shutdown_grace + 10)
    if ranks is not None:
        _stop_ranks(ranks)
    if not server.started:
        raise DtorchError(f"dtorch serve: the HTTP server did not start on {args.host}:{args.port} (see its log)")
    return 0


def _stop_ranks(ranks: Any) -> None:
    """After the drain on rank 0: every rank told to stop, each acknowledging; a rank lost before or meanwhile
    ends this process with status 2 naming it (``Ranks.lose``)."""
    from dtorch.core.errors import CommunicationError

    if ranks.lost is None:
        try:
            ranks.leader.stop()
            return
        except CommunicationError as exc:
            ranks.lose(str(exc))
    ranks.wait_exit()
