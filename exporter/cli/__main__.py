"""``python -m specdeploy.exporter.cli``: the ``specdeploy`` command."""

from specdeploy.exporter.cli import main

main()
