"""`python -m rngaudit` runs the command line."""

from .cli import main

main()
