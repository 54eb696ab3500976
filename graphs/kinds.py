"""The names of the draft kinds whose modules live here.

graphs/ imports neither the runtime nor the exporter, so it cannot read the runtime's draft-kind
descriptions (``runtime/drafters/kinds.py``); it spells the names of the kinds it builds once, here, and
``tests/test_layout.py`` checks that they are the runtime's.
"""

from __future__ import annotations

CHIMERA = "chimera"
MEDUSA = "medusa"
CERBERUS = "cerberus"
