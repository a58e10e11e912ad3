"""Celery tasks: thin wrappers that parse a ref, call library code, return a ref."""
