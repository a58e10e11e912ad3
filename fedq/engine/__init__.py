"""Celery plumbing: the app and its settings, the Redis result backend, the atomic
filesystem transport, broker checks, and the queue and task names."""
