"""Research probes: one-off studies, each answering one question of an earlier issue (research/README.md).

Not part of the shipped packages; nothing in gguf_s3d8, convert or qat imports it.
"""
