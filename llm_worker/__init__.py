"""LLM worker: the target model, drafters, verification and the decode loop."""
