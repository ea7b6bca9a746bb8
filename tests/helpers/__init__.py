"""Shared test helpers, by topic: ``models`` (tiny models, engines, greedy identity with ``ar``, cost
curves, prompts), ``stats`` (exact distributions and χ² tests of sampling), ``datastores`` (tiny
sparse and dense datastore versions and engines that draft from them), ``servers`` (worker, shard
and redis servers on ephemeral ports, polling) and ``induction_model`` (a hand-built induction
head). Test modules import from here, never from each other or from ``conftest``."""
