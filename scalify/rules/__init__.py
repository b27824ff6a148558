"""Scale rules, one module per primitive family. Importing this package registers them all."""
from scalify.rules import (  # noqa: F401
    control_flow,
    elementwise,
    linalg,
    reductions,
    structural,
)
