"""`deepinfer chat`: an interactive multi-turn chat over gRPC streaming, one Triton sequence per conversation.

Each user line is one turn: a ``messages`` input holding only the new message, sent with the
conversation's sequence_id (START on the first turn). The server keeps the history (an engine session),
so a turn sends and prefills only what is new. Replies stream to stdout as they are generated.
Commands: /reset starts a new conversation, /exit (or end of input) quits.
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import sys
from dataclasses import dataclass
from typing import TextIO

import numpy as np

MODEL_NAME = "deepinfer"


@dataclass
class TurnResult:
    text: str
    finish_reason: str
    num_output_tokens: int


def _inputs(messages: list[dict[str, str]], sampling: dict[str, object]) -> list:
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value: object, dtype: str) -> grpcclient.InferInput:
        array = np.array([value], dtype=np.object_ if dtype == "BYTES" else bool)
        item = grpcclient.InferInput(name, [1], dtype)
        item.set_data_from_numpy(array)
        return item

    return [tensor("messages", json.dumps(messages).encode(), "BYTES"),
            tensor("sampling_parameters", json.dumps(sampling).encode(), "BYTES"),
            tensor("stream", True, "BOOL"),
            tensor("return_finish_reason", True, "BOOL"),
            tensor("return_num_output_tokens", True, "BOOL")]


class ChatSession:
    """One conversation = one Triton sequence on one gRPC stream."""

    def __init__(self, url: str, model: str = MODEL_NAME, sampling: dict[str, object] | None = None,
                 system: str | None = None) -> None:
        import tritonclient.grpc as grpcclient

        self._client = grpcclient.InferenceServerClient(url=url)
        self._model = model
        self._sampling = dict(sampling or {})
        self._system = system
        self._results: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._results.put((result, error)))
        self.reset()

    def reset(self) -> None:
        self.session_id = random.randrange(1, 2**62)
        self._started = False

    def send(self, user_text: str, out: TextIO | None = None, timeout_s: float = 600.0) -> TurnResult:
        messages = [{"role": "user", "content": user_text}]
        if not self._started and self._system:
            messages.insert(0, {"role": "system", "content": self._system})
        inputs = _inputs(messages, self._sampling)
        self._client.async_stream_infer(self._model, inputs, sequence_id=self.session_id,
                                        sequence_start=not self._started, sequence_end=False,
                                        enable_empty_final_response=True)
        pieces: list[str] = []
        finish_reason, num_tokens = "", 0
        while True:
            result, error = self._results.get(timeout=timeout_s)
            if error is not None:  # a refused first turn (e.g. server busy) leaves the next one to START again
                raise RuntimeError(f"server error: {error}")
            text = result.as_numpy("text_output")
            if text is not None and text.size:
                piece = text.reshape(-1)[0].decode("utf-8")
                pieces.append(piece)
                if out is not None:
                    out.write(piece)
                    out.flush()
            reason = result.as_numpy("finish_reason")
            if reason is not None and reason.size:
                finish_reason = reason.reshape(-1)[0].decode()
            count = result.as_numpy("num_output_tokens")
            if count is not None and count.size:
                num_tokens += int(count.reshape(-1)[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                self._started = True
                return TurnResult("".join(pieces), finish_reason, num_tokens)

    def close(self) -> None:
        self._client.stop_stream()
        self._client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer chat", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC endpoint")
    parser.add_argument("--model", default=MODEL_NAME)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--system", default=None, help="system prompt for each new conversation")
    args = parser.parse_args(argv)

    sampling: dict[str, object] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                                   "top_p": args.top_p}
    if args.seed is not None:
        sampling["seed"] = args.seed
    chat = ChatSession(args.url, args.model, sampling, args.system)
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                sys.stdout.write("\nyou> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line or line.strip() == "/exit":
                return 0
            line = line.strip()
            if not line:
                continue
            if line == "/reset":
                chat.reset()
                print("(new conversation)")
                continue
            sys.stdout.write("assistant> ")
            try:
                result = chat.send(line, out=sys.stdout)
            except RuntimeError as exc:  # e.g. the history no longer leaves room for max_tokens: say so, go on
                print(f"\n[{exc}]\n(/reset starts a new conversation)")
                continue
            sys.stdout.write("\n" if result.finish_reason != "length" else " [max_tokens reached]\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 0
    finally:
        chat.close()
