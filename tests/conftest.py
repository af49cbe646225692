"""Shared pytest hooks and fixtures."""

from tools import test_times


# ---- test times (tools/test_times.py): the run record (--times-record), test files longest
# first, the quick tier (--quick). Its hooks live in that module, registered here as a plugin.
def pytest_addoption(parser, pluginmanager):
    """Registers tools/test_times.py (its options and hooks) as a plugin."""
    pluginmanager.register(test_times, "test-times")


# ---- end of test times
