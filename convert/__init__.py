"""The HF -> GGUF converter (``convert/to_gguf.py``) and its helpers.

Importing the package first makes the patched llama.cpp tree's gguf-py the process's ``gguf``
(``convert.upstream_tree``): the converter drives that tree's ``convert_hf_to_gguf`` machinery.
"""

from .upstream_tree import put_tree_gguf_first

put_tree_gguf_first()
