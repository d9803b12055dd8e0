"""`python -m kvchat` runs the CLI."""

from kvchat.cli import main

main()
