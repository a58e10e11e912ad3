"""Seeing a job: figures (``fedq plot``), a shareable HTML report (``fedq report``) and
Prometheus metrics (``fedq metrics``). Everything here reads what the coordinator
recorded in SQL; nothing here runs on the round's path."""
