"""The ``specdeploy`` command line.

User errors (``SpecDeployError``) print as one line without a traceback; anything else is a bug and
keeps its traceback. ``generate`` and ``serve`` import only the lean runtime (no torch); commands
that trace or train import torch lazily.
"""

from __future__ import annotations

import os

import click
from specdeploy.exporter.cli.check import build, lint, validate
from specdeploy.exporter.cli.decode import bench, bench_serve, generate, serve
from specdeploy.exporter.cli.export import export
from specdeploy.exporter.cli.train import train
from specdeploy.runtime.errors import SpecDeployError

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecDeployError as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            ctx.exit(130)


@click.group(cls=_Group)
@click.version_option(package_name="specdeploy")
def main() -> None:
    """specdeploy: export LLMs with their drafts to ONNX/TensorRT and decode them fast and losslessly."""


for _command in (export, train, validate, lint, build, generate, bench, serve, bench_serve):
    main.add_command(_command)
