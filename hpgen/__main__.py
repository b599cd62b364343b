"""``python -m hpgen`` runs the command line."""

from hpgen.cli import main

main()
