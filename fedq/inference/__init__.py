"""Batch inference on the training machines (``fedq infer``): a model, a list of
inputs cut into shards, each shard a Celery task on a hardware queue, each shard's
output one JSONL blob written once, merged in input order (docs/inference.md)."""
