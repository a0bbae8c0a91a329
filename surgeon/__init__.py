"""model-surgeon: model surgery and multimodal assembly from checkpoints you already have."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# `python -m surgeon` (and `accelerate launch -m surgeon`) run from a source checkout put the
# checkout's root on sys.path, where kernels/ (surgeon's Triton kernels, installed as
# surgeon.kernels) would shadow PyPI's `kernels`, which transformers imports when it is installed.
# Nothing is ever imported from that root (surgeon itself is installed), so it is taken off the path.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "kernels", "__init__.py")):
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _checkout]
