"""The fronts: what turns the outside world into engine calls and back. ``triton/`` (the Python-backend codec,
metrics, and the ``deepinfer serve`` launcher with its process lifelines), ``openai/`` (the OpenAI-compatible HTTP
front, a client of Triton) and ``cli/`` (the ``deepinfer`` command and its chat client). Top layer: it imports the
engine and below; nothing imports it."""
