"""`python -m backend_lib.openai_api`: the OpenAI front as its own process (started by `deepinfer serve`).

With --parent-pid it dies with that process (the kernel's parent-death signal), as the engine's worker ranks do
(backend_lib/executor/process_group.py `die_with_parent`, not imported here: that module imports torch, which
the front has no use for).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM from the kernel when the parent exits (uvicorn then shuts down); a parent already gone ends us now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend_lib.openai_api", description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-url", default="localhost:8001", help="Triton's gRPC endpoint")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--triton-model", default="deepinfer", help="the model's name in Triton")
    parser.add_argument("--served-model-name", default="deepinfer", help="the name clients give as \"model\"")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)

    import uvicorn

    from backend_lib.openai_api.app import FrontSettings, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(FrontSettings(grpc_url=args.grpc_url, triton_model=args.triton_model,
                                   served_model_name=args.served_model_name))
    # One worker: the front is I/O bound and its CPU is taken from the engine's cores.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
