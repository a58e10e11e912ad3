"""``python -m fedq.cli``: the fedq command."""

from fedq.cli import main

main()
