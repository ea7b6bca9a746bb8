"""Datastore service: versions, sparse (suffix array) and dense (FAISS) retrieval, shard servers,
the fan-out client."""
