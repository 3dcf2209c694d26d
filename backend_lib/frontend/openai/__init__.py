"""An OpenAI-compatible HTTP front in front of the Triton model (`deepinfer serve --openai-port PORT`)."""
