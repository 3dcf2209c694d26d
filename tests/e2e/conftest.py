"""The e2e tests' fixtures: one real tritonserver per test module (tests/helpers/triton_server.py)."""
from tests.helpers.triton_server import triton  # noqa: F401 - registers the fixture
