"""VQA evaluation of Llama 3.2 Vision models: VQAv2, ChartQA, DocVQA and AI2D, as the paper's authors ran it.

Modules:

* :mod:`qat.eval.examples` - the :class:`Example` record every reader yields;
* :mod:`qat.eval.readers` - one reader per dataset, for its published local file layout;
* :mod:`qat.eval.tasks` - prompts, generation lengths, default subset seeds and scoring rules per task;
* :mod:`qat.eval.scoring` - the metrics (prefix-match VQA accuracy, ChartQA 5 % accuracy, ANLS, AI2D option);
* :mod:`qat.eval.subset` - the fixed seeded subset (the indices ``datasets.Dataset.shuffle(seed)`` would pick);
* :mod:`qat.eval.backends` - the :class:`Backend` protocol, a transformers backend and an OpenAI-compatible one;
* :mod:`qat.eval.runner` - run one task on one backend, write the result JSON atomically;
* ``python -m qat.eval`` - the command line (``--help``).

See ``docs/evaluation.md`` for the dataset layouts and commands.
"""

from qat.eval.backends import Backend, OpenAIBackend, TransformersBackend
from qat.eval.examples import Example
from qat.eval.readers import read_dataset
from qat.eval.runner import evaluate, write_results
from qat.eval.subset import subset_indices
from qat.eval.tasks import TASKS, Task

__all__ = ["Backend", "Example", "OpenAIBackend", "TASKS", "Task", "TransformersBackend", "evaluate",
           "read_dataset", "subset_indices", "write_results"]
