"""Agents for tests/rollout/test_agents.py (imported by their module:attr paths), and a sample hook that keeps what
the end-to-end run generated."""

import asyncio
import threading

import httpx

SAMPLES = []  # what record_sample saw, in order


async def two_turns(base_url, prompt):
    """Asks, then asks again after a user follow-up, repeating the conversation as the endpoint returned it."""
    messages = [{"role": "user", "content": prompt.prompt}]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for follow_up in ("Sure?", None):
            answer = (await client.post("/chat/completions", json={"messages": messages})).raise_for_status().json()
            messages.append(answer["choices"][0]["message"])
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})


def sync_one_turn(base_url, prompt):
    httpx.post(f"{base_url}/chat/completions", json={"messages": [{"role": "user", "content": prompt.prompt}]},
               timeout=60).raise_for_status()  # fmt: skip


async def raises(base_url, prompt):
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        await client.post("/chat/completions", json={"messages": [{"role": "user", "content": prompt.prompt}]})
    raise RuntimeError("boom")


def record_sample(sample):
    """rollout.sample_hook_path: keep the sample's ids, mask, log-probs and conversation."""
    keys = ("messages", "num_turns", "stop_reason")
    SAMPLES.append({"prompt": sample.prompt, "tokens": sample.tokens, "response_length": sample.response_length,
                    "loss_mask": sample.loss_mask, "rollout_log_probs": sample.rollout_log_probs,
                    "status": str(sample.status), **{k: sample.metadata.get(k) for k in keys}})  # fmt: skip


RELEASE = threading.Event()  # set by the test that hangs agents, so their threads end with it


def sync_hangs(base_url, prompt):
    """One request, then blocks (a stuck tool or API call) until the test releases it."""
    sync_one_turn(base_url, prompt)
    RELEASE.wait(60)


async def async_hangs(base_url, prompt):
    await asyncio.sleep(3600)
