"""kvtier: a node-shared, tiered, persistent KV cache for vLLM on Kubernetes."""

import os as _os

__version__ = "0.1.0"

# operator/ is installed as the namespace package kvtier.operator: with an __init__.py it
# could shadow the standard library's `operator` for any Python started in the repository.
# setuptools' editable finder cannot serve a namespace subpackage, so in a checkout the
# import system is pointed at the repository root for it; a wheel has kvtier/operator/.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "operator")) and not _os.path.isdir(
    _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "operator")
):
    __path__.append(_root)
