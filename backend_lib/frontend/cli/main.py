"""`deepinfer` command line: generate | serve | chat | make-tiny | lint-graphs | worker."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommands implemented in their own modules, each exposing main(argv) -> int | None.
_DELEGATES = {
    "serve": ("backend_lib.frontend.triton.server", "run `tritonserver` with the DeepInfer model"),
    "chat": ("backend_lib.frontend.cli.chat", "interactive multi-turn chat over gRPC streaming (a session)"),
    "make-tiny": ("backend_lib.tools.tiny", "write a tiny random model directory for tests and demos"),
    "lint-graphs": ("backend_lib.tools.lint.cli", "check every compiled region for what neuronx-cc rejects"),
    "worker": ("backend_lib.worker.executor.node", "run this machine's ranks of a multi-node tensor-parallel engine"),
}


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer generate", description="Generate text, streamed to stdout.")
    parser.add_argument("prompt")
    parser.add_argument("--model", default="", help="GGUF file or Hugging Face directory (default: bundled SmolLM2)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weight-format", default="auto", choices=["auto", "packed", "dequantize"],
                        help="auto: quantized files stay packed (int8 activations on GGUF); dequantize: the file's "
                             "exact weights in the model dtype (docs/CONFIGURATION.md)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (processes) the model is split over")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="partition MoE experts across the ranks instead of sharding each expert")
    args = parser.parse_args(argv)

    from backend_lib.core.config import EngineConfig
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the load log says which weights it chose
    engine = LLMEngine(EngineConfig.from_flat({"model": args.model, "dtype": args.dtype,
                                               "weight_format": args.weight_format,
                                               "tensor_parallel_size": args.tensor_parallel_size,
                                               "enable_expert_parallel": args.enable_expert_parallel}))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _DELEGATES:
        module = importlib.import_module(_DELEGATES[argv[0]][0])
        return module.main(argv[1:]) or 0
    if argv and argv[0] == "generate":
        return _generate(argv[1:])
    lines = ["usage: deepinfer <command> [options]", "", "commands:",
             "  generate     generate text for a prompt, streamed to stdout"]
    lines += [f"  {name:<12} {help_text}" for name, (_, help_text) in _DELEGATES.items()]
    print("\n".join(lines), file=sys.stderr if argv else sys.stdout)
    return 2 if argv else 0


if __name__ == "__main__":
    sys.exit(main())
