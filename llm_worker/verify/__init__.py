"""Verification: tree buffers for one target forward, and the accept / reject rules."""
