"""Run by the vLLM interpreter (tests/test_vllm_launch.py): parse a server argv with vLLM's own
parser, as ``python -m vllm.entrypoints.openai.api_server`` does, and build vLLM's app from it
(no engine: nothing is loaded) to send requests through its middleware stack.

    python -m tests.helpers.vllm_probe_worker '<json argv after -m module>' \
        '<json [[method, path, key], ...]>'

Prints one JSON object: the parsed engine and frontend settings and, per request, the status
(``status``; ``status_bare``: the same app built without the ``--middleware`` entries).
"""

import argparse
import json
import sys

from starlette.testclient import TestClient
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

ENGINE_KEYS = (
    "model",
    "served_model_name",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "dtype",
    "seed",
    "logprobs_mode",
    "worker_extension_cls",
    "enforce_eager",
    "max_model_len",
    "gpu_memory_utilization",
)

argv, requests = json.loads(sys.argv[1]), json.loads(sys.argv[2])
args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
validate_parsed_serve_args(args)
engine = AsyncEngineArgs.from_cli_args(args)
out = {k: getattr(engine, k) for k in ENGINE_KEYS}
out.update(
    host=args.host,
    port=args.port,
    middleware=args.middleware,
    api_key=args.api_key,
    enable_scale_out=args.enable_scale_out,
)
for name, app_args in (
    ("status", args),
    ("status_bare", argparse.Namespace(**{**vars(args), "middleware": []})),
):
    client = TestClient(build_app(app_args, ("generate",)), raise_server_exceptions=False)
    out[name] = [
        client.request(
            method,
            path,
            json={"method": "noop"},
            headers={"Authorization": f"Bearer {key}"} if key else {},
        ).status_code
        for method, path, key in requests
    ]
print(json.dumps(out, default=str))
