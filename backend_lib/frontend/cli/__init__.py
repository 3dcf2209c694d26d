"""The ``deepinfer`` command line: ``main.py`` (generate, and the subcommands it delegates to their modules) and
``chat.py`` (``deepinfer chat``: a multi-turn gRPC streaming client on one session)."""
