"""`python -m rlc`."""

from rlc.cli import main

main()
