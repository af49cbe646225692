"""A plain agent that knows nothing about areal-mega: it talks to whatever OpenAI-compatible
server OPENAI_BASE_URL / OPENAI_API_KEY name, with the official ``openai`` package, and prints
its reward as the last line of stdout.

Task (the tiny CPU demo's): reverse a digit string. The prompt item comes as one JSON object on
stdin (``{"prompt": "48312=", "answer": "21384", ...}``); the reward is the fraction of
characters of the reply that match the answer.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=... python agent.py < item.json
"""

import json
import sys

from openai import OpenAI


def char_match(text: str, want: str) -> float:
    """Fraction of positions where ``text`` matches ``want``, over the longer of the two."""
    if not text and not want:
        return 1.0
    return sum(a == b for a, b in zip(text, want)) / max(len(text), len(want))


def main() -> None:
    item = json.loads(sys.stdin.readline())
    client = OpenAI(max_retries=0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    reply = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": item["prompt"]}],
        max_tokens=int(item.get("max_tokens", 6)),
        temperature=1.0,
    )
    text = reply.choices[0].message.content or ""
    print(f"reply: {text!r}", file=sys.stderr)
    print(json.dumps({"reward": char_match(text.strip(), str(item["answer"]))}))


if __name__ == "__main__":
    main()
