"""specdraft's bottom layer: the generated gRPC stubs (``specdraft.v1``, from ``proto/``), their
loader (``stubs``) and the few utilities every layer above shares (``common``).

Nothing here imports ``datastore_svc``, ``llm_worker`` or ``client`` (the layers contract in
``.importlinter``).
"""
