"""A torch.compile backend that lints each region's graph for what neuronx-cc rejects or runs slowly.

Use ``torch.compile(fn, backend=LintBackend(), fullgraph=True, dynamic=False)``: every captured graph is
checked (after AOT lowering to aten ops, which is what neuronx-cc receives) and ``GraphLintError`` names the
node and gives a hint. ``deepinfer lint-graphs`` (``cli.py``) runs it over every region of a tiny Llama, a tiny
DeepSeek-V3 and a tiny DeepSeek-V4 (``regions.py``: decode at each batch bucket, prefill buckets, lm_head, sampler
variants, draft verification).

Rules (the error codes are neuronx-cc's where one exists):
  int64-constant    a constant outside the int32 range (NCC_ESFH001)
  data-dependent    nonzero / item / _local_scalar_dense / unique / masked_select: output shape or a host value
                    depends on data
  multinomial       host-style sampling; use the seeded Gumbel-max draw (kernels/sampling.py)
  bitcast           a dtype view of a graph input (reinterpreting bytes; neuronx-cc miscompiles it)
  integer-topk      topk / sort over an integer tensor
  integer-matmul    mm / bmm / matmul / linear over integer tensors
  remainder         torch.remainder / fmod (~140 ms a call on the device); use a - (a // b) * b
  uint8-assembly    bitwise ops producing uint8 (byte assembly; NCC_IINL902); keep int32 codes, narrow once
  dynamic-shape     a symbolic size in the graph (compile with dynamic=False and bucket the shapes)
  collective        a collective other than the fixed-shape all-reduce / all-gather / reduce-scatter / broadcast
                    (e.g. an all-to-all with data-dependent splits)
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import fx

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

_DATA_DEPENDENT = {"nonzero", "item", "_local_scalar_dense", "unique", "_unique", "_unique2", "unique_consecutive",
                   "unique_dim", "masked_select", "nonzero_static_unsupported"}
_MATMUL = {"mm", "bmm", "matmul", "addmm", "baddbmm", "linear", "dot", "mv", "einsum"}
_REMAINDER = {"remainder", "fmod"}
_BITWISE = {"bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift",
            "__lshift__", "__rshift__", "__and__", "__or__", "__xor__"}
_STATIC_COLLECTIVES = {"all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                       "broadcast_", "wait_tensor"}
_INTEGER = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)

HINTS = {
    "int64-constant": "neuronx-cc rejects 64-bit constants outside int32 (NCC_ESFH001): keep constants below 2**31",
    "data-dependent": "no host syncs or data-dependent shapes in a region: mask with torch.where instead",
    "multinomial": "use the seeded Gumbel-max draw (kernels.sampling.gumbel_argmax)",
    "bitcast": "do not reinterpret a graph input's bytes: pass the tensor in the dtype the graph reads",
    "integer-topk": "topk / sort on integers is rejected: cast the keys to float32 first",
    "integer-matmul": "integer matmul has no engine on Neuron: cast to float / bf16",
    "remainder": "torch.remainder is ~140 ms a call on the device: write a - (a // b) * b",
    "uint8-assembly": "uint8 byte assembly crashes neuronx-cc (NCC_IINL902): compute in int32, narrow once",
    "dynamic-shape": "compile with dynamic=False and pad to a bucket: Neuron graphs are static",
    "collective": "inside a region use fixed-shape all-reduce / all-gather / reduce-scatter (Neuron's static form)",
}


@dataclass(frozen=True)
class LintFinding:
    rule: str
    node: str  # the FX node name
    target: str  # the op
    detail: str

    def __str__(self) -> str:
        return f"[{self.rule}] node {self.node} ({self.target}): {self.detail}. Hint: {HINTS[self.rule]}"


class GraphLintError(RuntimeError):
    def __init__(self, region: str, findings: list[LintFinding]) -> None:
        self.findings = findings
        lines = "\n  ".join(str(f) for f in findings)
        super().__init__(f"region {region!r} breaks {len(findings)} Neuron graph rule(s):\n  {lines}")


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _meta(value) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _node_tensor(node) -> torch.Tensor | None:
    return _meta(node.meta.get("val")) if isinstance(node, fx.Node) else None


def _is_integer(node) -> bool:
    t = _node_tensor(node)
    return t is not None and t.dtype in _INTEGER


def _has_symbolic_shape(value) -> bool:
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape):
            return True
        if isinstance(v, torch.SymInt):
            return True
    return False


_OPEN_BOUND_OPS = {"slice", "slice_scatter", "narrow"}  # sys.maxsize there means "to the end", not a constant


def _constants(node: fx.Node) -> Iterator[int]:
    if _op_name(node) in _OPEN_BOUND_OPS:
        return
    for arg in [*node.args, *node.kwargs.values()]:
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool):
                yield item


def lint_graph(gm: fx.GraphModule) -> list[LintFinding]:
    """Every rule over every node of an (aten-level) FX graph."""
    findings: list[LintFinding] = []
    inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and _has_symbolic_shape(node.meta.get("val")):
            findings.append(LintFinding("dynamic-shape", node.name, "input", "input has a symbolic size"))
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if (isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.numel()
                    and (value.min() < INT32_MIN or value.max() > INT32_MAX)):
                findings.append(LintFinding("int64-constant", node.name, str(node.target),
                                            "int64 constant tensor outside the int32 range"))
        if node.op not in ("call_function", "call_method"):
            continue
        # call_method nodes only appear in dynamo's graph (x.item(), x.nonzero()), before AOT lowers them.
        name = node.target if node.op == "call_method" else _op_name(node)
        target = str(node.target)
        if "c10d" in target and name not in _STATIC_COLLECTIVES:
            findings.append(LintFinding("collective", node.name, target, f"{name} is not a static collective"))
        if name in _DATA_DEPENDENT:
            findings.append(LintFinding("data-dependent", node.name, target, f"{name} depends on tensor data"))
        if name == "multinomial":
            findings.append(LintFinding("multinomial", node.name, target, "multinomial sampling"))
        if name in _REMAINDER:
            findings.append(LintFinding("remainder", node.name, target, f"{name} is slow on the device"))
        if name in ("topk", "sort", "argsort") and _is_integer(node.args[0]):
            findings.append(LintFinding("integer-topk", node.name, target,
                                        f"{name} over {_node_tensor(node.args[0]).dtype}"))
        if name in _MATMUL and any(_is_integer(a) for a in node.args if isinstance(a, fx.Node)):
            findings.append(LintFinding("integer-matmul", node.name, target, f"{name} over integer tensors"))
        if name in _BITWISE:
            out = _node_tensor(node)
            if out is not None and out.dtype == torch.uint8:
                findings.append(LintFinding("uint8-assembly", node.name, target, f"{name} producing uint8"))
        if name == "view" and len(node.args) > 1 and isinstance(node.args[1], torch.dtype) \
                and node.args[0] in inputs:
            findings.append(LintFinding("bitcast", node.name, target,
                                        f"dtype view of graph input {node.args[0].name} as {node.args[1]}"))
        for value in _constants(node):
            if not INT32_MIN <= value <= INT32_MAX:
                findings.append(LintFinding("int64-constant", node.name, target, f"constant {value}"))
        if _has_symbolic_shape(node.meta.get("val")):
            findings.append(LintFinding("dynamic-shape", node.name, target, "symbolic output size"))
    return _dedupe(findings)


def _dedupe(findings: list[LintFinding]) -> list[LintFinding]:
    seen: set[tuple[str, str]] = set()
    out = []
    for f in findings:
        if (f.rule, f.node) not in seen:
            seen.add((f.rule, f.node))
            out.append(f)
    return out


@dataclass
class LintBackend:
    """torch.compile backend: lint the aten graph of each region, then run it eagerly (aot_eager semantics)."""

    region: str = "region"
    graphs_checked: int = 0
    findings: list[LintFinding] = field(default_factory=list)

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        # Dynamo-level: ops that never reach AOT as themselves (item, nonzero graph breaks under fullgraph).
        self._check(gm)

        def inspect(aten_gm: fx.GraphModule, _inputs: list) -> Callable:
            self._check(aten_gm)
            return make_boxed_func(aten_gm.forward)

        return aot_autograd(fw_compiler=inspect)(gm, example_inputs)

    def _check(self, gm: fx.GraphModule) -> None:
        self.graphs_checked += 1
        found = lint_graph(gm)
        if found:
            self.findings.extend(found)
            raise GraphLintError(self.region, found)


def lint_region(fn: Callable, *args, region: str = "region", **kwargs):
    """Compile ``fn`` with the lint backend (fullgraph, static) and run it once on the inputs."""
    torch._dynamo.reset()
    backend = LintBackend(region)
    # Let data-dependent ops enter the graph (instead of breaking it) so the lint can name them.
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        try:
            out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            # dynamo wraps backend errors; the lint's own error is the message users need.
            inner = getattr(error, "inner_exception", None) or error.__cause__
            if isinstance(inner, GraphLintError):
                raise inner from None
            raise
    if backend.graphs_checked == 0:
        raise RuntimeError(f"region {region!r}: no graph was captured (was it compiled before?)")
    return out
