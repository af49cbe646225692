"""A test agent whose behaviour the prompt item picks (``mode``): ``ok`` (one chat call, then
its reward), ``crash`` (raises), ``hang`` (sleeps in a child process too, so only a
process-group kill ends it), ``noreward`` (calls, then prints no reward), ``badreward``
(prints a reward that is not a number). It knows only OPENAI_BASE_URL / OPENAI_API_KEY."""

import json
import subprocess
import sys

from openai import OpenAI

item = json.loads(sys.stdin.readline())
mode = item["mode"]
if mode == "crash":
    raise RuntimeError("agent crashed on purpose")
if mode == "hang":
    subprocess.run(["sleep", "300"])
client = OpenAI(max_retries=0)
r = client.chat.completions.create(
    model="m",
    messages=[{"role": "user", "content": item["prompt"]}],
    max_tokens=4,
    logit_bias={"0": -100, "1": -100, "2": -100},
)
print("some log line")
if mode == "ok":
    print(json.dumps({"reward": len(r.choices[0].message.content) / 4}))
elif mode == "badreward":
    print(json.dumps({"reward": "high"}))
