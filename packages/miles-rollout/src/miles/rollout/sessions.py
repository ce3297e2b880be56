"""Rollout sessions: an OpenAI-compatible chat-completions endpoint per sample, so an existing agent framework drives
the policy while Miles records the exact ids and log-probs (token-in-token-out).

    with SessionServer(engine, tokenizer) as server:
        session_id = server.open(prompt, sampling=sampling, seed=seed, max_response_tokens=512)
        await agent(f"{server.url}/sessions/{session_id}/v1", prompt)  # POST {base_url}/chat/completions
        sample = server.close_session(session_id)

The first request's messages are rendered with the chat template (``TurnRenderer.prompt_tokens``). Each later
request must repeat the conversation so far: the earlier requests' messages and the assistant messages this endpoint
returned, unchanged on role, content and tool calls; only its new messages are rendered, as a suffix
(``TurnRenderer.suffix_tokens``), appended with loss mask 0, and the engine's response ids follow with mask 1 and
its log-probs. A request whose history differs gets HTTP 400: a conversation is never re-tokenized. What a request
may hold is ``miles.rollout.openai_chat``; docs/agentic.md ("Agents over an OpenAI endpoint") has the rules.

``miles.rollout.agents`` (rollout.multi_turn.agent_path) plugs an agent into training: each sample is one session.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from miles.core.buffer import sample_seed
from miles.core.config import SamplingConfig
from miles.core.logs import warn_once
from miles.core.protocols import Engine, GenerateOutput, GenerateRequest, RequestFailed
from miles.core.sample import Sample, SampleStatus
from miles.rollout.generate import engine_output_problem, known_versions
from miles.rollout.openai_chat import (
    ChatRequest,
    assistant_message,
    canonical_message,
    completion,
    error,
    first_difference,
    parse_chat_request,
)
from miles.rollout.tito import Trajectory, TurnRenderer

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0  # in-flight requests get this long to finish when the server stops
LOOPBACK = ("127.0.0.1", "::1", "localhost")

# How a session ended (metadata["stop_reason"]) -> the sample's status.
SESSION_STOP_STATUS = {
    "stop": SampleStatus.COMPLETED,  # the last turn ended at a stop token without a tool call
    "tool_calls": SampleStatus.COMPLETED,  # the last turn called tools and the agent ended there
    "length": SampleStatus.TRUNCATED,  # the last turn was cut at rollout.sampling.max_new_tokens or max_tokens
    "max_response_tokens": SampleStatus.TRUNCATED,  # a turn cut at the budget, or new messages that would fill it
    "max_turns": SampleStatus.TRUNCATED,  # the agent asked for a turn past max_turns
    "abort": SampleStatus.ABORTED,  # a turn cut off by Engine.pause("abort") after its resubmits
}


@dataclass(eq=False)
class _Session:
    """One sample's conversation. Mutated by one request at a time (``busy``), and under the server's lock where
    ``close_session`` could read it meanwhile."""

    id: str
    prompt: Sample
    sampling: SamplingConfig
    seed: int
    max_response_tokens: int
    loop: asyncio.AbstractEventLoop | None  # where engine.generate runs (None: the server's own loop)
    renderer: TurnRenderer | None = None  # built by the first request, with its tools
    tools: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    trajectory: Trajectory | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # canonical: requests' and returned messages
    num_turns: int = 0
    num_tool_calls: int = 0
    resubmits: int = 0
    finish_reason: str = ""  # the last engine finish
    response_text: str = ""  # the last turn's text
    stop_reason: str | None = None  # set once no further turn can be generated (budget, max_turns, abort)
    failure: str | None = None
    busy: bool = False
    closed: bool = False


class _Failed(Exception):
    """A request that fails its session (the sample is not trained): HTTP ``status`` with the reason."""

    def __init__(self, reason: str, status: int) -> None:
        super().__init__(reason)
        self.status = status


class SessionServer:
    """An OpenAI-compatible chat-completions endpoint per rollout session, ``POST /sessions/{id}/v1/chat/completions``,
    served by uvicorn in a background thread (``with SessionServer(...) as server``, or ``start()`` / ``close()``).

    Args:
        engine: any ``miles.core.Engine``. A session's requests run on the event loop that was running when it was
            opened (the rollout's, where the engine's other requests run: they batch together, and server engines'
            loop-bound clients stay on their loop); that loop must stay free meanwhile (await the agent, or run a
            sync agent in a thread). A session opened outside an event loop runs them on the server's own loop.
        tokenizer: the policy's HF tokenizer (chat template; decodes turns).
        host: the address to bind. No authentication: keep the default loopback address.
        port: the port; 0 (the default) = a free one (``url`` says which).
        max_turns: model turns per session; a request past them answers finish "length" (stop_reason "max_turns").
        max_prompt_tokens: a first request rendering to more tokens fails its session (HTTP 400).
        max_resubmits: a turn cut off by ``Engine.pause("abort")`` is requested again with the same seed, up to this
            many times per session; then the session ends ABORTED.
        mask_stale_segments: at ``close_session``, mask the model tokens of older weights
            (``Trajectory.mask_stale_tokens``).
        chat_template: jinja source to render with instead of the tokenizer's template; None = the tokenizer's.
        chat_template_kwargs: extra template variables of every rendering (e.g. ``enable_thinking``).
        model_name: the ``model`` of every answer (requests' ``model`` is ignored).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_turns: int = 4,
        max_prompt_tokens: int = 2048,
        max_resubmits: int = 0,
        mask_stale_segments: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        model_name: str = "miles-policy",
    ) -> None:
        if tokenizer is None:
            raise ValueError("a session server needs the policy's tokenizer (its chat template renders the messages)")
        if max_turns < 1:
            raise ValueError(f"max_turns is {max_turns}; a session needs at least 1 turn")
        if host not in LOOPBACK:
            logger.warning("session server binds %s: it has no authentication, anyone who reaches it drives the policy",
                           host)  # fmt: skip
        self.engine, self.tokenizer = engine, tokenizer
        self.host, self.port = host, port
        self.max_turns, self.max_prompt_tokens, self.max_resubmits = max_turns, max_prompt_tokens, max_resubmits
        self.mask_stale_segments = mask_stale_segments
        self.chat_template, self.chat_template_kwargs = chat_template, dict(chat_template_kwargs or {})
        self.model_name = model_name
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()  # the sessions table, and session state close_session reads
        self._server: Any = None  # uvicorn.Server while running
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.app = FastAPI(title="miles sessions", docs_url=None, redoc_url=None, openapi_url=None)

        @self.app.post("/sessions/{session_id}/v1/chat/completions")
        async def chat_completions(session_id: str, request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                body = None  # refused by parse_chat_request
            status, answer = await self.chat_completion(session_id, body)
            return JSONResponse(answer, status_code=status)

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://host:port`` of the running server. Raises: RuntimeError when it is not running."""
        if self._socket is None:
            raise RuntimeError("the session server is not running; start it (with SessionServer(...) as server)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._socket.getsockname()[1]}"

    def start(self) -> SessionServer:
        """Bind and serve in a daemon thread; returns once it answers. Raises: RuntimeError if it is running or
        does not start; OSError when the address cannot be bound."""
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("the session server is already running")
        self._socket = socket.create_server((self.host, self.port), family=_family(self.host))
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=int(STOP_TIMEOUT_S))  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="miles-sessions", daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the session server on {self.host}:{self.port} did not start")
            time.sleep(0.005)
        logger.debug("session server listening on %s", self.url)
        return self

    def close(self) -> None:
        """Stop serving and join the thread (in-flight requests get ``STOP_TIMEOUT_S``); open sessions stay open.
        Idempotent."""
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(STOP_TIMEOUT_S + 5)
        if self._thread.is_alive():
            logger.warning("the session server thread did not stop within %.0f s", STOP_TIMEOUT_S + 5)
        self._socket.close()
        self._thread = self._server = self._socket = None

    def __enter__(self) -> SessionServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sessions ------------------------------------------------------------------------------------
    def open(self, prompt: Sample, *, sampling: SamplingConfig, seed: int, max_response_tokens: int) -> str:
        """Open a session for one sample; returns its id (the agent's ``base_url`` is ``{url}/sessions/{id}/v1``).

        Args:
            prompt: the prompt's sample (its ``prompt``, ``label``, ``metadata`` and indices go to the result).
            sampling: how every turn samples (``max_new_tokens`` bounds each turn; requests cannot change it).
            seed: turn k samples with ``sample_seed(seed, k)``.
            max_response_tokens: budget of the whole response: model ids, rendered messages, template glue.
        Raises: ValueError when max_response_tokens < 1.
        """
        if max_response_tokens < 1:
            raise ValueError(f"max_response_tokens is {max_response_tokens}; a session needs at least 1 token")
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        session = _Session(uuid.uuid4().hex, prompt, sampling, seed, max_response_tokens, loop)
        with self._lock:
            self._sessions[session.id] = session
        return session.id

    def close_session(self, session_id: str) -> Sample:
        """End a session (later requests get 404) and return its sample: ``tokens`` = the first request's rendering,
        then per turn the rendered new messages (mask 0, log-prob 0.0) and the engine's ids (mask 1, its log-probs);
        ``status`` from ``SESSION_STOP_STATUS`` (FAILED, with ``metadata["failure"]`` and no response, when no turn
        was generated or a request failed the session); ``metadata`` ``messages`` (the conversation, canonical),
        ``num_turns``, ``num_tool_calls``, ``stop_reason``, ``finish_reason``.

        Raises: KeyError for an id that is not open.
        """
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise KeyError(f"no open session {session_id!r}")
            session.closed = True
            return self._sample(session)

    def _sample(self, session: _Session) -> Sample:
        prompt = session.prompt
        sample = Sample(index=prompt.index, group_index=prompt.group_index, prompt=prompt.prompt, label=prompt.label,
                        metadata=dict(prompt.metadata))  # fmt: skip
        sample.metadata.update(messages=list(session.messages), num_turns=session.num_turns,
                               num_tool_calls=session.num_tool_calls)  # fmt: skip
        if session.resubmits:
            sample.metadata["resubmits"] = session.resubmits
        failure = session.failure or (None if session.num_turns else "the agent made no chat-completion request")
        if failure is not None:
            fail_sample(sample, failure, session.prompt_tokens)
            return sample
        trajectory = session.trajectory
        assert trajectory is not None  # a turn was generated
        if self.mask_stale_segments:
            trajectory.mask_stale_tokens()
        stop_reason = session.stop_reason
        if stop_reason is None:
            called = bool(session.messages[-1].get("tool_calls"))
            stop_reason = "tool_calls" if called and session.finish_reason == "stop" else session.finish_reason
        sample.tokens, sample.response_length = trajectory.tokens, trajectory.response_length
        sample.loss_mask, sample.rollout_log_probs = trajectory.loss_mask, trajectory.rollout_log_probs
        sample.weight_versions, sample.weight_version = trajectory.weight_versions, trajectory.weight_versions[-1]
        sample.token_versions = known_versions(trajectory.token_versions)
        sample.rollout_routed_experts = trajectory.routed_experts
        sample.response_text = session.response_text
        sample.status = SESSION_STOP_STATUS[stop_reason]
        sample.metadata.update(stop_reason=stop_reason, finish_reason=session.finish_reason)
        return sample

    # -- the endpoint --------------------------------------------------------------------------------
    async def chat_completion(self, session_id: str, body: Any) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON answer) of one request: 200 with a ``chat.completion``; 400 for a request the endpoint
        refuses or whose history diverges; 404 for a session that is not open; 409 while the session answers
        another request, or after it failed; 500/502 when the engine failed (the session fails)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                message = f"no open session {session_id!r}: a session exists from SessionServer.open to close_session"
                return 404, error(message, kind="not_found_error")
            if session.busy:
                return 409, error(f"session {session_id} is answering another request; send one at a time",
                                  kind="conflict_error")  # fmt: skip
            session.busy = True
        try:
            chat = parse_chat_request(body)
            if session.failure is not None:
                return 409, error(f"session {session_id} failed: {session.failure}", kind="conflict_error")
            if chat.ignored:
                warn_once(logger, "chat-completion requests set %s, which sessions ignore: every turn samples with "
                          "rollout.sampling (the log-probs Miles trains on)", ", ".join(chat.ignored))  # fmt: skip
            return 200, await self._answer(session, chat)
        except ValueError as err:
            return 400, error(str(err), kind="invalid_request_error")
        except _Failed as err:
            with self._lock:
                session.failure = str(err)
            return err.status, error(str(err), kind="invalid_request_error" if err.status == 400 else "server_error")
        finally:
            session.busy = False

    async def _answer(self, session: _Session, chat: ChatRequest) -> dict[str, Any]:
        """Generate one turn and record it. Raises: ValueError (400, nothing recorded), _Failed (fails the session)."""
        new_messages, suffix = self._new_turn(session, chat)
        trajectory = session.trajectory
        if session.stop_reason is not None:  # ended: nothing more is generated or recorded
            with self._lock:
                session.messages += new_messages
            return self._completion(session, {"role": "assistant", "content": ""}, "length", 0)
        assert trajectory is not None
        budget = session.max_response_tokens - trajectory.response_length - len(suffix)
        max_new = min(session.sampling.max_new_tokens, budget, chat.max_tokens or budget)
        sampling = session.sampling
        if max_new != sampling.max_new_tokens:  # unchanged otherwise, so the engine batches turns together
            sampling = sampling.model_copy(update={"max_new_tokens": max_new})
        request = GenerateRequest(
            trajectory.tokens + suffix, sampling, seed=sample_seed(session.seed, session.num_turns)
        )
        output = await self._generate(session, request)
        text = self.tokenizer.decode(output.response_tokens, skip_special_tokens=True)
        message = assistant_message(text, call_id_prefix=f"call_{session.id[:12]}_{session.num_turns}")
        with self._lock:
            if session.closed:
                raise _Failed(f"session {session.id} was closed while its turn was generated", 409)
            trajectory.add_env_turn(suffix)
            trajectory.add_model_turn(output)
            session.messages += [*new_messages, canonical_message(message, len(session.messages))]
            session.num_turns += 1
            session.num_tool_calls += len(message.get("tool_calls", ()))
            session.finish_reason, session.response_text = output.finish_reason, text
            if output.finish_reason == "abort":
                session.stop_reason = "abort"
            elif output.finish_reason == "length" and max_new == budget:
                session.stop_reason = "max_response_tokens"
        finish = ("tool_calls" if "tool_calls" in message else "stop") if output.finish_reason == "stop" else "length"
        return self._completion(session, message, finish, len(output.response_tokens))

    def _new_turn(self, session: _Session, chat: ChatRequest) -> tuple[list[dict[str, Any]], list[int]]:
        """(the request's new messages, their rendering as ids) after checking them against the session; sets
        ``stop_reason`` when no turn can follow (max_turns, budget). Raises: ValueError (400), _Failed."""
        if session.stop_reason is not None:
            return [], []
        if session.trajectory is None:  # the first request: its messages are the prompt
            if chat.messages[-1]["role"] == "assistant":
                raise ValueError("the last message is an assistant message: continuing a partial assistant turn is "
                                 "not supported; end the messages with a user or tool message")  # fmt: skip
            renderer = TurnRenderer(self.tokenizer, tools=chat.tools, chat_template=self.chat_template,
                                    chat_template_kwargs=self.chat_template_kwargs)  # fmt: skip
            tokens = _render(renderer.prompt_tokens, chat.messages)
            with self._lock:
                session.renderer, session.tools, session.prompt_tokens = renderer, chat.tools, tokens
            if len(tokens) > self.max_prompt_tokens:
                raise _Failed(f"the messages render to {len(tokens)} prompt tokens > max_prompt_tokens "
                              f"{self.max_prompt_tokens}", 400)  # fmt: skip
            with self._lock:
                session.trajectory = Trajectory(list(tokens))
            return list(chat.messages), []
        if chat.tools != session.tools:
            raise ValueError("'tools' differ from the first request's, which the prompt was rendered with; send the "
                             "same tools in every request of a session")  # fmt: skip
        difference = first_difference(session.messages, chat.messages)
        if difference is not None:
            raise ValueError(
                f"the messages do not continue this session's conversation: {difference}. Repeat the earlier "
                "messages and the assistant messages this endpoint returned unchanged, then add the new ones "
                "(Miles appends new messages to the recorded ids and never re-tokenizes a conversation)"
            )
        new_messages = chat.messages[len(session.messages) :]
        if not new_messages:
            raise ValueError("no new message after the conversation so far: add the tool results or a user message")
        for i, message in enumerate(new_messages, start=len(session.messages)):
            if message["role"] == "assistant":
                raise ValueError(f"messages[{i}] is a new assistant message: the assistant turns of a session are "
                                 "the ones this endpoint returned; send user or tool messages")  # fmt: skip
        if session.num_turns == self.max_turns:
            session.stop_reason = "max_turns"
            return new_messages, []
        assert session.renderer is not None and session.trajectory is not None
        last_token = session.trajectory.response_tokens[-1]
        suffix = _render(session.renderer.suffix_tokens, new_messages, last_token=last_token)
        if session.trajectory.response_length + len(suffix) >= session.max_response_tokens:
            session.stop_reason = "max_response_tokens"  # no room for a model token after them: not appended
            return new_messages, []
        return new_messages, suffix

    async def _generate(self, session: _Session, request: GenerateRequest) -> GenerateOutput:
        """The turn's engine output, requested again after an abort while the session has resubmits left.
        Raises: _Failed for a failed request or an output that cannot be trained on."""
        while True:
            try:
                output = await self._on_engine_loop(session.loop, request)
            except RequestFailed as err:
                raise _Failed(str(err), 502) from err
            except Exception as err:  # noqa: BLE001 - the engine's error fails this session, answered as a 500
                raise _Failed(f"the engine raised {type(err).__name__}: {err}", 500) from err
            if output.finish_reason != "abort" or session.resubmits == self.max_resubmits:
                break
            session.resubmits += 1
        aborted_before_sampling = output.finish_reason == "abort" and not output.response_tokens
        problem = None if aborted_before_sampling else engine_output_problem(output)
        if problem is not None:
            raise _Failed(problem, 502)
        return output

    async def _on_engine_loop(self, loop: asyncio.AbstractEventLoop | None, request: GenerateRequest) -> GenerateOutput:
        if loop is None:
            return await self.engine.generate(request)
        if loop.is_closed():
            raise RuntimeError("the event loop that opened the session has closed")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.engine.generate(request), loop))

    def _completion(
        self, session: _Session, message: dict[str, Any], finish: str, num_completion: int
    ) -> dict[str, Any]:
        """The answer; usage counts this turn's prompt (the whole trajectory before it) and its response ids."""
        trajectory = session.trajectory
        num_prompt = len(trajectory.tokens) - num_completion if trajectory is not None else 0
        return completion(completion_id=f"chatcmpl-{session.id[:12]}-{session.num_turns}", model=self.model_name,
                          message=message, finish_reason=finish, prompt_tokens=num_prompt,
                          completion_tokens=num_completion)  # fmt: skip


def fail_sample(sample: Sample, reason: str, prompt_tokens: list[int]) -> None:
    """Mark a sample FAILED with its response dropped (prompt ids kept, no log-prob), as the other rollouts do:
    counted in samples/failed, never trained."""
    sample.status = SampleStatus.FAILED
    sample.metadata["failure"] = reason
    sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = list(prompt_tokens), 0, None, []
    sample.token_versions = None


def _render(render: Callable[..., list[int]], messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """``render(messages, **kwargs)``; a template error becomes a ValueError (HTTP 400) that says so."""
    try:
        return render(messages, **kwargs)
    except Exception as err:  # noqa: BLE001 - jinja's TemplateError (e.g. raise_exception in the template), ...
        raise ValueError(f"the chat template cannot render these messages: {type(err).__name__}: {err}") from err


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
