"""``python -m fedq.cli``: the fedq command."""

from fedq.cli.commands import main

main()
