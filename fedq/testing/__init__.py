"""Helpers shared by the tests and the benchmarks: worker subprocesses, a whole test
deployment, throwaway databases on the real services."""
