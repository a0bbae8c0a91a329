"""model-surgeon: model surgery and multimodal assembly from checkpoints you already have."""

import importlib.util as _util
import os as _os
import sys as _sys

__version__ = "0.1.0"

# The Triton kernels live in the checkout's top-level kernels/ and are the subpackage
# surgeon.kernels. That folder has no __init__.py, so Python started in the checkout's root never
# mistakes it for PyPI's `kernels` (which transformers imports): a folder without one loses to an
# installed package. A wheel copies it into surgeon/kernels/; an editable install maps it, but
# setuptools' editable finder maps only folders with an __init__.py, so here it is made a namespace
# package by hand, the same thing a wheel's import system builds from surgeon/kernels/.
_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout_kernels = _os.path.join(_os.path.dirname(_here), "kernels")
_ours = _os.path.isfile(_os.path.join(_checkout_kernels, "paged_attention.py")) and _os.path.isfile(
    _os.path.join(_os.path.dirname(_here), "pyproject.toml")
)  # the checkout's own kernels/, never a site-packages neighbour of that name
if not _os.path.isdir(_os.path.join(_here, "kernels")) and _ours:
    _spec = _util.spec_from_loader(f"{__name__}.kernels", None, is_package=True)
    _spec.submodule_search_locations = [_checkout_kernels]
    kernels = _sys.modules[_spec.name] = _util.module_from_spec(_spec)
