"""pytest set-up shared by the Python tests.

``import convert`` first: it loads the patched llama.cpp tree's gguf-py as this process's ``gguf`` (the converter
drives that tree's ``convert_hf_to_gguf``, ``convert/upstream_tree.py``), so the tests and the converter they call
in-process use one ``gguf`` module.
"""

import convert  # noqa: F401
