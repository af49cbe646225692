"""Fixtures shared by several test modules (pytest finds them here; no test imports them).

* ``models`` / ``server``: two tiny llama models and one CPU rollout server on the first
  (:mod:`tests.helpers.rollout`), for the rollout, inference and OpenAI-surface tests;
* ``assets``: the tiny digits model and the reverse-task data of the ``launch.local``
  end-to-end runs (:mod:`tests.helpers.local_runs`).

Each is module-scoped: a module's tests share one, and a module that defines a fixture of the
same name uses its own. Imports are inside the fixtures so that collecting a test that uses
none of them stays cheap.

The test-time plugin (:mod:`tools.test_times`: the run record ``--times-record``, test files
longest first, the quick tier ``--quick``) is registered here.
"""

import pytest

import areal_mega  # noqa: F401  (megatron-core's first import in these processes: ours)
from tools import test_times


def pytest_addoption(parser, pluginmanager):
    """Registers tools/test_times.py (its options and hooks) as a plugin."""
    pluginmanager.register(test_times, "test-times")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The two tiny models as paths (``a``, ``b``) and loaded transformers models (``ma``,
    ``mb``)."""
    from tests.helpers.rollout import load_model, make_models

    a, b = make_models(tmp_path_factory)
    return {"a": a, "b": b, "ma": load_model(a), "mb": load_model(b)}


@pytest.fixture(scope="module")
def server(models):
    """One CPU rollout server process on model ``a`` (with
    :data:`tests.helpers.rollout.API_KEY`), stopped after the module."""
    from areal_mega.inference.process import launch_local_servers
    from tests.helpers.rollout import API_KEY

    procs = launch_local_servers(str(models["a"]), 1, api_key=API_KEY)
    try:
        yield procs[0]
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """``(model, data_dir)``: a tiny digits llama and the reverse task's train / test files."""
    from areal_mega.data.synthetic import write_task_files
    from areal_mega.models.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("e2e")
    model = make_tiny_model(
        d / "model",
        arch="llama",
        charset="digits",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    )
    write_task_files(d / "data", task="reverse", n_train=512, n_test=32)
    return model, d / "data"
