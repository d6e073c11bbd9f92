"""Quantisation-aware training support: fake-quantised weight formats (``qat.formats``) and, later, the
torch S3D8 fake-quantiser and training loop."""
