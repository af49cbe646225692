"""A teacher server process that fails the way a real one can, in front of a real one.

    python -m tests.helpers.faulty_teacher_worker --upstream http://127.0.0.1:P --port Q --log FILE

Every request is forwarded to ``--upstream`` (a CPU server process; headers, so the API key,
pass through). Faults, counted over the ``/generate`` (scoring) requests:

1. the first is answered 503 (a blip: the scorer marks the server down);
2. the second is forwarded, then the first sequence's logprobs are replaced by NaN and, when
   it has two or more, its second by +7 (a broken teacher);
3. every later one passes unchanged (the teacher recovered).

Each ``/generate`` appends one JSON line to ``--log``: ``{"n", "fault"}``.
"""

from __future__ import annotations

import argparse
import json

import aiohttp
from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True)
    args = ap.parse_args()
    count = [0]

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        if request.path == "/generate":
            count[0] += 1
            fault = {1: "503", 2: "nan"}.get(count[0], "none")
            with open(args.log, "a") as f:
                f.write(json.dumps({"n": count[0], "fault": fault}) + "\n")
            if fault == "503":
                return web.Response(status=503, text="teacher overloaded")
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type")
        }
        async with aiohttp.ClientSession() as s:
            async with s.request(
                request.method, args.upstream + request.path_qs, data=body, headers=headers
            ) as r:
                status, text = r.status, await r.text()
        if request.path == "/generate" and fault == "nan" and status == 200:
            answers = json.loads(text)
            entries = answers[0]["meta_info"]["input_token_logprobs"]
            entries[1][0] = float("nan")  # entry 0 is the context's None
            if len(entries) > 2:
                entries[2][0] = 7.0
            text = json.dumps(answers)  # NaN as the JSON literal Python writes
        return web.Response(status=status, text=text, content_type="application/json")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
