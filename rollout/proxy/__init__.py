"""``rollbook proxy``: an OpenAI-compatible HTTP endpoint that records an agent's calls as trajectories.

    rollbook proxy --server 127.0.0.1:50551 --model_id tiny --port 8000     # prints 'listening on http://HOST:PORT'

An unchanged agent points its ``openai`` client at ``http://HOST:PORT/v1`` with a session key as its
API key. Every completion comes from a ``GenerationEngine`` (rollout/engine.py; vLLM where installed)
and is recorded, with its prompt and output token ids, behavior log-probs, per-token versions and
sampling parameters, as a trajectory of the calling session. Endpoints, errors and the admin key:
docs/online.md.

Control: the admin key is the store's (``ROLLBOOK_ADMIN_KEY``); starting a session takes the worker
key (``ROLLBOOK_WORKER_KEY``) or the admin key. With a key unset its endpoints are open, allowed on
loopback only, as for the store. The proxy reaches the store only through ``StoreClient``.

The modules, from the wire inwards:

| module | what |
|---|---|
| ``config`` | ``ProxyConfig``, the command's flags |
| ``server`` | ``serve`` (the command), ``ProxyServer`` (uvicorn on a thread), ``build_engine``, the loopback rule |
| ``app`` | ``create_app``: the completion endpoints (answered before FastAPI), the FastAPI routes, body limits, error answers |
| ``schemas`` | the request bodies (OpenAI and control) and ``ApiError``, the OpenAI-format error |
| ``admission`` | ``Gate``: completions at once, waiting, pauses |
| ``core`` | ``Proxy``: keys, completions, rewards, session ends, weight installs |
| ``streaming`` | ``TokenStream``: a streamed completion whose tokens leave as the engine samples them |
| ``payloads`` | response bodies, the server-sent events of a completion, text pieces per token |
| ``history`` | token-exact multi-turn histories: the prompt of a session's next call and the call it continues |
| ``sessions`` | sessions, logical calls and attempts, the trajectories they become, rewards, submission |
| ``render`` | the tokenizer and chat rendering, tool-call parsing (``renderer()``) |

Importing this package loads nothing; ``config`` loads only pydantic.
"""
