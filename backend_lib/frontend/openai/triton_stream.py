"""Our Triton model over KServe gRPC streaming (grpc.aio, raw protobufs), one ModelStreamInfer call per request.

One call per request, so that cancelling it (the HTTP client went away) cancels exactly that request: Triton
marks it cancelled, and the model aborts it in the engine, which frees its KV blocks. Raw protobufs on one
asyncio channel rather than tritonclient's thread-per-stream client: the front shares the machine's cores
with the engine, and every response it handles costs CPU the engine loses. The request names the outputs it
reads, so the model builds only those.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from backend_lib.frontend.openai.errors import OpenAIError, from_model_error, unreachable
from backend_lib.frontend.openai.translate import ModelDelta, ModelRequest

_BASE_OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")
_RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


def _bytes_elements(raw: bytes) -> list[bytes]:
    """A BYTES tensor's raw contents: each element is a 4-byte little-endian length, then the bytes."""
    items, at = [], 0
    while at < len(raw):
        size = int.from_bytes(raw[at:at + 4], "little")
        items.append(raw[at + 4:at + 4 + size])
        at += 4 + size
    return items


def build_infer_request(model: str, request_id: str, request: ModelRequest) -> service_pb2.ModelInferRequest:
    infer = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    if request.prompt_input == "input_ids":
        ids = infer.inputs.add(name="input_ids", datatype="INT32", shape=[len(request.prompt)])
        ids.contents.int_contents.extend(request.prompt)
    else:
        infer.inputs.add(name=request.prompt_input, datatype="BYTES", shape=[1]).contents.bytes_contents.append(
            str(request.prompt).encode("utf-8"))
    infer.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        json.dumps(request.sampling).encode("utf-8"))
    if request.images:  # base64 text each, as the model's image input takes them
        infer.inputs.add(name="image", datatype="BYTES", shape=[len(request.images)]).contents.bytes_contents.extend(
            image.encode("utf-8") for image in request.images)
    # Echo, not streamed: the model puts the prompt's text (an input_ids prompt decoded) before the completion.
    flags = {"stream": request.stream, "exclude_input_in_output": not (request.echo and not request.stream),
             **{name: True for name in _RETURN_FLAGS}}
    if request.logprobs:
        flags["return_logprobs"] = True
    for name, value in flags.items():
        infer.inputs.add(name=name, datatype="BOOL", shape=[1]).contents.bool_contents.append(value)
    outputs = _BASE_OUTPUTS + (("logprobs",) if request.logprobs else ())
    for name in outputs + (("prompt_logprobs",) if "prompt_logprobs" in request.sampling else ()):
        infer.outputs.add(name=name)
    infer.parameters["triton_enable_empty_final_response"].bool_param = True
    if request.session is not None:
        session = request.session
        if isinstance(session.sequence_id, int):
            infer.parameters["sequence_id"].int64_param = session.sequence_id
        else:
            infer.parameters["sequence_id"].string_param = session.sequence_id
        infer.parameters["sequence_start"].bool_param = session.start
        infer.parameters["sequence_end"].bool_param = session.end
    return infer


def parse_response(result: service_pb2.ModelInferResponse) -> ModelDelta:
    delta = ModelDelta(text="", num_output_tokens=0, num_input_tokens=None, finish_reason=None)
    for index, output in enumerate(result.outputs):
        raw = result.raw_output_contents[index] if index < len(result.raw_output_contents) else b""
        if output.name == "text_output":
            delta.text = b"".join(_bytes_elements(raw)).decode("utf-8")
        elif output.name == "num_output_tokens":
            delta.num_output_tokens = int.from_bytes(raw[:4], "little")
        elif output.name == "num_input_tokens":
            delta.num_input_tokens = int.from_bytes(raw[:4], "little")
        elif output.name == "finish_reason":
            elements = _bytes_elements(raw)
            delta.finish_reason = elements[0].decode() if elements else None
        elif output.name in ("logprobs", "prompt_logprobs"):
            elements = _bytes_elements(raw)
            setattr(delta, output.name, json.loads(elements[0]) if elements else None)
    return delta


async def _end_completed(call: grpc.aio.StreamStreamCall, timeout_s: float = 5.0) -> None:
    """After a request's last response: half-close and read the server's end of the stream, so the call ends
    as completed, not cancelled. A cancel racing Triton's own end of the stream (after an error response) left
    the model referenced in ~1 of 4 runs: Triton then never finalized it and waited out its exit timeout."""
    try:
        await call.done_writing()
        await asyncio.wait_for(call.read(), timeout_s)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError) as exc:  # the caller's finally cancels the call
        logging.getLogger("deepinfer.openai").warning("could not end a Triton stream as completed (%r): "
                                                      "cancelling it", exc)


class TritonStreamClient:
    """The front's one channel to Triton; ``generate`` streams one request's deltas."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        self._channel = grpc.aio.insecure_channel(url, options=[("grpc.max_receive_message_length", 2**30)])
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def ready(self) -> bool:
        try:
            response = await self._stub.ModelReady(service_pb2.ModelReadyRequest(name=self.model), timeout=5)
        except grpc.aio.AioRpcError:
            return False
        return response.ready

    async def model_parameter(self, name: str) -> str:
        """A parameter of the model's config (config.pbtxt), e.g. ``model``: the path the engine loaded."""
        try:
            response = await self._stub.ModelConfig(service_pb2.ModelConfigRequest(name=self.model), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise unreachable(f"{exc.code().name}: {exc.details()}") from exc
        parameter = response.config.parameters.get(name)
        return parameter.string_value if parameter is not None else ""

    async def generate(self, request_id: str, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        """The model's responses up to its final one. An error response raises OpenAIError; closing the
        generator early (the HTTP client left, or an exception) cancels the gRPC call, which cancels the
        request in the engine."""
        call = self._stub.ModelStreamInfer()
        try:
            await call.write(build_infer_request(self.model, request_id, request))
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise OpenAIError(502, f"request {request_id}: Triton closed the stream before the final "
                                           "response", "server_error")
                if response.error_message:  # the request's last response
                    await _end_completed(call)
                    raise from_model_error(response.error_message, request.field_names)
                result = response.infer_response
                final = result.parameters["triton_final_response"].bool_param
                if result.outputs or not final:
                    yield parse_response(result)
                if final:
                    await _end_completed(call)
                    return
        except grpc.aio.AioRpcError as exc:
            raise unreachable(f"{exc.code().name}: {exc.details()}") from exc
        finally:
            # A no-op when the call completed; otherwise Triton cancels the request (the model then aborts it).
            call.cancel()
