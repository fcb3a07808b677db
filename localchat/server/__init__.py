"""``localchat serve``: the OpenAI and Anthropic chat APIs over the same session, conversations
and persistent, exact prompt cache as the rest of localchat.

The modules: ``app.py`` (the ASGI application: routes, keys, limits, error shapes, one log
line per request), ``openai_api.py`` and ``anthropic_api.py`` (each API's requests checked
field by field into one ``ChatRequest``, and its responses and server-sent events),
``worker.py`` (the one thread that owns the session: requests run one at a time, in arrival
order, from a bounded queue; a client that goes away stops its reply).

Why Starlette on uvicorn: a small, standard ASGI stack (streaming responses, no framework
layer we would not use); requests are validated here, field by field, so that every wrong
type gets the API's own error shape rather than a framework's.
"""
