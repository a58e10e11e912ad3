"""The coordinator side: jobs, rounds, the round decision, finalize, the watchdog,
the aggregation pipeline, evaluation and the worker roster. Runs in the control
worker, beat, and whoever submits jobs; it alone talks to the database."""
