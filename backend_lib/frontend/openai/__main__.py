"""`python -m backend_lib.frontend.openai`: the OpenAI front as its own process (started by `deepinfer serve`).

With --parent-pid it dies with that process (the kernel's parent-death signal: SIGTERM, so uvicorn shuts down), as
the engine's worker ranks do (``backend_lib.core.processes``, torch-free: the front has no use for torch).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from backend_lib.core.processes import set_parent_death_signal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend_lib.frontend.openai",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-url", default="localhost:8001", help="Triton's gRPC endpoint")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--triton-model", default="deepinfer", help="the model's name in Triton")
    parser.add_argument("--served-model-name", default="deepinfer", help="the name clients give as \"model\"")
    parser.add_argument("--tokenizer", default=None,
                        help="the chat template for tools requests (.gguf or HF directory); default: the Triton "
                             "model's config parameter \"model\"")
    parser.add_argument("--allow-remote-images", action="store_true",
                        help="fetch chat image_url parts with http(s) URLs (default: refused; send data: URLs)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        set_parent_death_signal(signal.SIGTERM, args.parent_pid)

    import uvicorn

    from backend_lib.frontend.openai.app import FrontSettings, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(FrontSettings(grpc_url=args.grpc_url, triton_model=args.triton_model,
                                   served_model_name=args.served_model_name,
                                   tokenizer=args.tokenizer, allow_remote_images=args.allow_remote_images))
    # One worker: the front is I/O bound and its CPU is taken from the engine's cores.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
