"""The HF -> GGUF converter (``convert/to_gguf.py``) and its helpers.

Importing the package has no effect on the process: the ``gguf`` the converter and upstream's
``convert_hf_to_gguf`` (``convert/upstream_tree.py``) use is the environment's, the patch series' gguf-py that
``ci/setup.sh`` installs from the applied tree.
"""
