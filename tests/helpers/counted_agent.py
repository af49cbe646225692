"""A test agent whose outcome its prompt's position (``prompt_index``) decides, so the rollout
side's counts are known in advance: ``k % 3 == 1`` exits 1 on every attempt (the group fails
and, out of retries, is dropped); ``k % 3 == 2``: the first sample of the prompt to run prints
no reward (one ``agent_failed/no_reward``), the other succeeds; otherwise one chat call and a
reward. Prompts ``k >= HELD_FROM`` wait until ``$AGENT_GATE/open`` exists and prompts
``k >= STOP_AT`` wait for ever (the rollout worker kills them when it stops), so the worker
delivers nothing beyond what the test trains on."""

import json
import os
import sys
import time
from pathlib import Path

HELD_FROM, STOP_AT = 9, 12

item = json.loads(sys.stdin.readline())
k = int(item["prompt_index"])
gate = Path(os.environ["AGENT_GATE"])
if k >= STOP_AT or (k >= HELD_FROM and not (gate / "open").exists()):
    time.sleep(3600)
if k % 3 == 1:
    sys.exit(1)
from openai import OpenAI  # noqa: E402 (only the agents that call import it)

client = OpenAI(max_retries=0)
r = client.chat.completions.create(
    model="m", messages=[{"role": "user", "content": item["prompt"]}], max_tokens=4
)
if k % 3 == 2:
    try:
        os.close(os.open(gate / f"noreward-{k}", os.O_CREAT | os.O_EXCL))
        print("done, but no reward line")
        sys.exit(0)
    except FileExistsError:
        pass
print(json.dumps({"reward": len(r.choices[0].message.content) / 4}))
