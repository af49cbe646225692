"""The OpenAI-compatible surface against a CPU rollout server, as its tests drive it: the logit
bias that keeps text round-tripping, a tool-call chat template, a client that records every
answer the servers sent, a controller over it, and plain HTTP calls (weights, token counts,
POSTs of raw bodies)."""

import json
import time
import urllib.request

from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.controller import RolloutController
from tests.helpers.rollout import API_KEY, http, run

NO_SPECIAL = {"0": -100, "1": -100, "2": -100}  # <pad>, <eos>, <unk>: text round-trips

HERMES_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "{% endif %}{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ m.content }}"
    "{%- for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{%- elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{%- else %}{{ m.content }}{% endif %}{%- endfor %}"
)


class RecordingClient(RolloutClient):
    """The production client, keeping every /generate answer the servers sent."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.answers: list = []

    async def generate(self, input_ids, sampling_params, rid=None, sticky_key=None, **kw):
        res = await super().generate(
            input_ids, sampling_params, rid=rid, sticky_key=sticky_key, **kw
        )
        self.answers.append((rid, res))
        return res


def wait_for(cond, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def server_tokens(addr) -> int:
    req = urllib.request.Request(
        f"http://{addr}/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["tokens_generated"]


def load_weights(addr, path):
    async def go():
        c = RolloutClient([addr], api_key=API_KEY)
        try:
            await c.update_weights_from_disk(str(path), weight_version=0)
        finally:
            await c.close()

    run(go())


def controller(addr, wf, tok, sink, n_prompts, batch_size, n_samples):
    client = RecordingClient([addr], api_key=API_KEY, timeout_s=120, retries=2)
    items = [{"prompt": "abcdefgh"[i % 8 :] + "xyz", "answer": ""} for i in range(n_prompts)]
    return RolloutController(
        client,
        wf,
        items,
        batch_size=batch_size,
        n_samples=n_samples,
        eta=0,
        sink=sink,
        tokenizer=tok,
        ignore_eos=True,
    )


def post(addr, path, body, key):
    """(status, answer) of a POST; ``body`` bytes are sent as they are."""
    if isinstance(body, bytes):
        import urllib.error
        import urllib.request

        r = urllib.request.Request(
            f"http://{addr}{path}",
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {key}"},
        )
        try:
            with urllib.request.urlopen(r, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    return http(addr, path, body, key=key, timeout=60)
