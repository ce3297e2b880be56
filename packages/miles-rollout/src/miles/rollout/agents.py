"""Agent rollouts (rollout.mode multi_turn with rollout.multi_turn.agent_path): an existing agent, written against
the OpenAI chat-completions API, generates each sample by talking to its own session of a ``SessionServer``
(``miles.rollout.sessions``), which records the exact ids, loss mask and log-probs of the conversation.

    async def agent(base_url: str, prompt: Sample) -> None:  # or a sync function (run in a worker thread)
        async with httpx.AsyncClient() as client:
            answer = (await client.post(f"{base_url}/chat/completions", json={"messages": [...]})).json()
            ...  # run the answer's tool_calls, append the results, ask again; return when done

examples/plugins/session_agent.py is a runnable one; docs/agentic.md ("Agents over an OpenAI endpoint") the rules.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from miles.core.config import SamplingConfig
from miles.core.plugins import load_plugin
from miles.core.protocols import GroupGenerateFn
from miles.core.sample import Sample, SampleStatus
from miles.rollout.generate_factory import AGENT_KEY, GenerateContext
from miles.rollout.multiturn import in_daemon_thread
from miles.rollout.sessions import SessionServer, fail_sample

logger = logging.getLogger(__name__)


class AgentFn(Protocol):
    """``rollout.multi_turn.agent_path``: drives one sample's conversation through the OpenAI chat-completions API
    at ``base_url`` (``POST {base_url}/chat/completions``, any OpenAI client) and returns when it is done; async, or
    sync (then run in a daemon thread). ``prompt`` is the data's prompt sample (``prompt``, ``label``,
    ``metadata``); do not modify it. Raising fails the sample (``metadata["failure"]``)."""

    def __call__(self, base_url: str, prompt: Sample) -> Any: ...


class AgentRollout:
    """``GroupGenerateFn`` of an agent: each sample is one session of a ``SessionServer`` that the agent drives.

    The server listens while groups are generated: the first group in flight starts it, the last one to finish
    stops it (so nothing listens between steps or after the run; a restart takes a fresh port).

    Args:
        server: the (stopped) session server.
        agent: the ``AgentFn``.
        max_response_tokens: each session's budget (``rollout.multi_turn.max_response_tokens``).
        timeout_s: seconds one sample's agent may take (``rollout.multi_turn.agent_timeout_s``); None = no limit.
    """

    def __init__(
        self, server: SessionServer, agent: AgentFn, *, max_response_tokens: int, timeout_s: float | None = None
    ) -> None:
        self.server, self.agent, self.max_response_tokens = server, agent, max_response_tokens
        self.timeout_s = timeout_s
        self._is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__)
        self._users = 0
        self._lock = threading.Lock()

    async def generate_group(
        self,
        prompt: Sample,
        *,
        n: int,
        sampling: SamplingConfig,
        seeds: Sequence[int],
    ) -> list[Sample]:
        """``GroupGenerateFn``: n sessions of one prompt, their agents run concurrently; sample j's turn k samples
        with ``sample_seed(seeds[j], k)``. Returns: n samples, index 0 .. n-1 (see ``SessionServer.close_session``;
        an agent that raised fails its sample). Raises: ValueError if ``len(seeds) != n``."""
        if len(seeds) != n:
            raise ValueError(f"generate_group got {len(seeds)} seeds for n={n} samples; pass one seed per sample")
        await asyncio.to_thread(self._acquire)
        try:
            samples = await asyncio.gather(*(self._one(prompt, sampling, seed) for seed in seeds))
        finally:
            await asyncio.to_thread(self._release)
        for j, sample in enumerate(samples):
            sample.index = j
        return samples

    async def _one(self, prompt: Sample, sampling: SamplingConfig, seed: int) -> Sample:
        session_id = self.server.open(
            prompt, sampling=sampling, seed=seed, max_response_tokens=self.max_response_tokens
        )
        base_url = f"{self.server.url}/sessions/{session_id}/v1"
        failure = None
        # A sync agent runs in a daemon thread of its own: one past the timeout keeps only its thread (asyncio's
        # default executor would be joined when the round's event loop closes, holding the round).
        call = self.agent(base_url, prompt) if self._is_async else in_daemon_thread(self.agent, base_url, prompt)
        task = asyncio.ensure_future(call)
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)  # not wait_for: an agent's own TimeoutError
        if not done:  # is its error, not this limit
            task.cancel()
            failure = f"the agent ran past rollout.multi_turn.agent_timeout_s ({self.timeout_s:g} s)"
        elif (err := task.exception()) is not None:  # the agent's error fails its sample only, never the run
            failure = f"the agent raised {type(err).__name__}: {err}"
        sample = self.server.close_session(session_id)
        if failure is not None and sample.status != SampleStatus.FAILED:
            fail_sample(sample, failure, sample.tokens[: sample.prompt_length])
        elif not done:  # the session's own reason (e.g. no request yet) follows from the hang: name the hang
            sample.metadata["failure"] = failure
        return sample

    def _acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self.server.start()
            self._users += 1

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self.server.close()


def build_agent_generate(context: GenerateContext) -> GroupGenerateFn:
    """``GenerateFactory`` of rollout.mode multi_turn with ``rollout.multi_turn.agent_path``: an ``AgentRollout`` over
    a ``SessionServer`` on 127.0.0.1 with the ``rollout.multi_turn`` budgets and template variables.

    Raises: ValueError when ``rollout.multi_turn.agent_path`` is empty; as ``load_plugin`` for a bad agent path.
    """
    config = context.rollout.multi_turn
    if not config.agent_path:
        raise ValueError(
            f"{AGENT_KEY} is empty, but miles.rollout.agents:build_agent_generate runs an agent; set "
            "--rollout.multi-turn.agent-path my_pkg.agents:agent"
        )
    agent = load_plugin(config.agent_path, key=AGENT_KEY)
    server = SessionServer(
        context.engine,
        context.tokenizer,
        max_turns=config.max_turns,
        max_prompt_tokens=context.max_prompt_tokens,
        max_resubmits=context.rollout.max_resubmits,
        mask_stale_segments=context.mask_stale_segments,
        chat_template_kwargs=config.chat_template_kwargs,
    )
    logger.info(
        "agent rollout: %s over a chat-completions endpoint per sample, at most %d turns and %d response tokens",
        config.agent_path,
        config.max_turns,
        config.max_response_tokens,
    )
    return AgentRollout(
        server, agent, max_response_tokens=config.max_response_tokens, timeout_s=config.agent_timeout_s
    ).generate_group
