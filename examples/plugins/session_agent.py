"""``rollout.multi_turn.agent_path``: an agent written against the OpenAI chat-completions API, as one of an agent
framework would be, trained through its Miles session (``miles.rollout.agents``). Plain httpx here; any OpenAI client
works the same way, e.g. ``openai.AsyncOpenAI(base_url=base_url, api_key="unused")``.

It offers the calculator tool, runs the calls the model makes and sends back their results, and asks the model once
to check its answer. Each request repeats the whole conversation, the assistant messages as they were returned.
"""

import json

import httpx
from miles.rollout.calculator import calculator
from miles.rollout.tools import ToolCall, run_tool_call

TOOLS = {calculator.name: calculator}
MAX_REQUESTS = 4
CHECK = "Check your answer, then give the final number."


async def agent(base_url, prompt):
    """(base_url: str, prompt: Sample) -> None."""
    messages = [{"role": "user", "content": prompt.prompt}] if isinstance(prompt.prompt, str) else list(prompt.prompt)
    checked = False
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        for _ in range(MAX_REQUESTS):
            body = {"model": "policy", "messages": messages, "tools": [calculator.schema()], "max_tokens": 64}
            response = await client.post("/chat/completions", json=body)
            response.raise_for_status()
            choice = response.json()["choices"][0]
            messages.append(choice["message"])
            if choice["finish_reason"] == "tool_calls":
                for call in choice["message"]["tool_calls"]:
                    name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
                    result = run_tool_call(ToolCall(name, arguments), TOOLS)
                    messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": result})
            elif not checked:
                messages.append({"role": "user", "content": CHECK})
                checked = True
            else:
                return
