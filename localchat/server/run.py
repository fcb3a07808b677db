"""``localchat serve``: load the model, open the session, and serve it with uvicorn.

Binds 127.0.0.1 by default; another address needs a key (``--api-key`` or
``LOCALCHAT_API_KEY``: the environment keeps it off the command line others can read).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

from ..errors import BadInput

LOOPBACK = {"localhost"}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def key_for(host: str, api_key: str | None) -> str | None:
    """The key clients must send (``--api-key``, else ``LOCALCHAT_API_KEY``); BadInput when
    ``host`` is reachable from other machines and there is none."""
    api_key = api_key or os.environ.get("LOCALCHAT_API_KEY") or None
    if not is_loopback(host) and not api_key:
        raise BadInput(f"--host {host} is reachable from other machines: give --api-key "
                       "(or LOCALCHAT_API_KEY) too")
    return api_key


def serve(session, host: str, port: int, api_key: str | None, queue: int,
          ready=None, context_overflow: str = "stop", max_batch: int | None = None) -> int:
    """Serve ``session`` until Ctrl-C (or SIGTERM). ``ready(port)``: told once it listens."""
    import asyncio

    import uvicorn

    from .app import Service, make_app
    from .worker import DEFAULT_MAX_BATCH, Worker

    api_key = key_for(host, api_key)
    try:  # bound here, so that a taken port or a foreign address is one line of ours
        family = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host.strip("[]"), port), family=family, backlog=64)
    except OSError as err:
        raise BadInput(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    worker = Worker(session, queue, max_batch or DEFAULT_MAX_BATCH, log=log)
    service = Service(worker, api_key, context_overflow=context_overflow)
    config = uvicorn.Config(make_app(service), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    bound = sock.getsockname()[1]
    print(f"localchat serve: {service.model} on http://{host}:{bound}/v1"
          + (" (key required)" if api_key else ""), file=sys.stderr, flush=True)
    if ready is not None:
        ready(bound)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    except KeyboardInterrupt:
        pass  # uvicorn shut down cleanly, then passed Ctrl-C on: the way a server stops
    print("localchat serve: stopped", file=sys.stderr, flush=True)
    return 0


def cmd_serve(args) -> int:
    """Serve the OpenAI and Anthropic chat APIs with the persistent prompt cache.

    POST /v1/chat/completions (OpenAI), POST /v1/messages and /v1/messages/count_tokens
    (Anthropic), GET /v1/models, GET /health. Each request continues the stored conversation
    its messages re-send (or branches it, or starts one), so turn N+1 prefills only what turn
    N did not leave in the cache — across restarts too. Ctrl-C stops the server.
    """
    from ..fmt import say
    from ..session.session import open_session

    if not 0 <= args.port <= 65535:
        raise BadInput("--port must be between 0 and 65535")
    if args.queue < 1:
        raise BadInput("--queue must be at least 1")
    if args.max_batch is not None and args.max_batch < 1:
        raise BadInput("--max-batch must be at least 1")
    key_for(args.host, args.api_key)  # before the model loads
    session = open_session(args.model, progress=say)
    session.speculate = getattr(args, "speculate", "lookup")
    for text in session.start_notices():
        say(text)
    try:
        return serve(session, args.host, args.port, args.api_key, args.queue,
                     context_overflow=args.context_overflow,
                     max_batch=getattr(args, "max_batch", None))
    finally:
        session.close()
