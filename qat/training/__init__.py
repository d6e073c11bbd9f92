"""The library behind ``python -m qat.train`` (:mod:`qat.train`, the command line), one module per concern, each
importing only those before it in this list:

* :mod:`qat.training.models`: the teacher, the fake-quantised student (fresh, from a checkpoint, from an S3D8
  tensor file), its trainable parameters;
* :mod:`qat.training.data`: training examples, batch order, batches (uses ``models.model_type``);
* :mod:`qat.training.loss`: logits at the loss positions, KL(teacher || student), the recipe's learning rate;
* :mod:`qat.training.distributed`: torchrun process group, FSDP2, full state dicts;
* :mod:`qat.training.loop`: :func:`qat.training.loop.train`, the run (uses all of the above).
"""
