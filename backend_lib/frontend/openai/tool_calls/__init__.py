"""The OpenAI front's tool calling: the request's tools and ``tool_choice`` (``choice.py``), and the parsers that
read a model's tool calls out of its text, whole or streamed (``parser_base.py``, ``parsers.py``)."""
