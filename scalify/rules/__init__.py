"""Scale rules, one module per primitive family. Importing this package registers them all."""
from scalify.rules import collectives  # noqa: F401  (after control_flow, whose helpers it uses)
from scalify.rules import (  # noqa: F401
    attention,
    control_flow,
    debugging,
    elementwise,
    linalg,
    reductions,
    structural,
)
