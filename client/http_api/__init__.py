"""The OpenAI-compatible HTTP front end (``specdraft serve http``): ``/v1/completions``,
``/v1/chat/completions`` (SSE streaming), ``/v1/models``, ``/health``, ``/metrics``.

- ``schema``: request bodies, the one mapping body → ``WorkRequest``, the answers' pieces;
- ``backends``: what generates — a ``Worker`` in this process, or a pool of gRPC workers (a
  list, or discovered in the registry) — behind one ``Backend`` protocol;
- ``app``: the Starlette routes, auth, errors and streaming over a backend;
- ``server``: uvicorn with the gRPC servers' TLS and exposure rules.
"""
