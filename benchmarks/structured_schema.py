"""The JSON schema benchmarks/structured.py constrains the shared workload with, in a module without imports so that
the vLLM anchor's own venv (benchmarks/vllm_structured.py) reads the same schema."""

# Long enough that a batch decodes for a while before the grammars complete.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "items": {"type": "array", "minItems": 4, "maxItems": 8, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                         "score": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["name", "score"], "additionalProperties": False}}},
    "required": ["title", "items"], "additionalProperties": False}
