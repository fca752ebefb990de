"""The readers' tests use the control plane's fakes: a real ControlTarget and a model stepped by a thread."""

from tests.control.conftest import target, trained  # noqa: F401 - fixtures, shared with tests/control
