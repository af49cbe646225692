"""A test agent (a plain ``openai`` script) that fails on nearly every task: it exits 1 unless
its prompt's ``prompt_index`` is a multiple of 10; then it makes one chat call and prints a
reward."""

import json
import sys

item = json.loads(sys.stdin.readline())
if int(item["prompt_index"]) % 10:
    sys.exit("cannot solve this task")  # exit code 1, the reason on stderr
from openai import OpenAI  # noqa: E402 (only the agents that call import it)

client = OpenAI(max_retries=0)
r = client.chat.completions.create(
    model="m", messages=[{"role": "user", "content": item["prompt"]}], max_tokens=4
)
print(json.dumps({"reward": len(r.choices[0].message.content) / 4}))
