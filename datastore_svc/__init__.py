"""Datastore service: sparse (suffix array) and dense (FAISS) retrieval shards — later issues."""
