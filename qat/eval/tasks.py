"""Per-task prompt, generation length, default subset seed and scorer (reference recipe section 7).

The prompts are the Meta ``llama3_2/eval_details.md`` templates as the authors used them (LM
``training/eval/vqa.py@e1cf``), with the AI2D options added (Meta's template omits them): ``"1) …\\n2) …\\n"``.
A backend puts the task prompt after the image in one user turn (see :mod:`qat.eval.backends`).

| task    | metric   | max new tokens | default seed | split the authors used        |
|---------|----------|----------------|--------------|-------------------------------|
| vqav2   | accuracy | 25             | 625464       | lmms-lab/VQAv2 validation     |
| chartqa | accuracy | 512            | 77524        | HuggingFaceM4/ChartQA test    |
| docvqa  | anls     | 512            | 37374        | lmms-lab/DocVQA validation    |
| ai2d    | accuracy | 400            | 85393        | lmms-lab/ai2d test            |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from qat.eval import scoring
from qat.eval.examples import Example

VQAV2_PROMPT = (
    "Look at the image carefully and answer this visual question. "
    "For yes/no questions, just respond Yes or No. "
    "If the answer is numeric, just respond with the number and nothing else. "
    "If the answer has multiple words, just respond with the words and absolutely nothing else. "
    "Never respond in a sentence or a phrase.\n "
    "Respond with as few words as possible.\n Question: {question}"
)
CHARTQA_PROMPT = (
    "You are provided a chart image and will be asked a question. "
    "You have to think through your answer and provide a step-by-step solution. "
    "Once you have the solution, write the final answer in at most a few words at the end "
    'with the phrase "FINAL ANSWER:". '
    "The question is: {question}<cot_start>Let's think step by step."
)
DOCVQA_PROMPT = (
    "Read the text in the image carefully and answer the question with the text as seen exactly in the image. "
    "For yes/no questions, just respond Yes or No. "
    "If the answer is numeric, just respond with the number and nothing else. "
    "If the answer has multiple words, just respond with the words and absolutely nothing else. "
    "Never respond in a sentence or a phrase.\n Question: {question}"
)
AI2D_PROMPT = (
    "Look at the scientific diagram carefully and answer the following question: {question}\n "
    "Think step by step and finally respond to the question with only the correct option number as "
    '"FINAL ANSWER". Options:\n{options}'
    "Let's think step by step."
)


def format_options(options: tuple[str, ...] | list[str]) -> str:
    return "".join(f"{i}) {o}\n" for i, o in enumerate(options, start=1))


@dataclass(frozen=True)
class Task:
    name: str
    metric: str
    max_new_tokens: int
    seed: int
    template: str
    score_fn: Callable[[str, Example], float]

    def prompt(self, ex: Example) -> str:
        """The user text for ``ex`` (the image goes before it)."""
        return self.template.format(question=ex.question, options=format_options(ex.options))

    def score(self, output: str, ex: Example) -> float:
        return self.score_fn(output, ex)


TASKS: dict[str, Task] = {
    "vqav2": Task("vqav2", "accuracy", 25, 625464, VQAV2_PROMPT,
                  lambda out, ex: scoring.vqa_accuracy(out, ex.answers)),
    "chartqa": Task("chartqa", "accuracy", 512, 77524, CHARTQA_PROMPT,
                    lambda out, ex: scoring.chartqa_accuracy(out, ex.answers[0])),
    "docvqa": Task("docvqa", "anls", 512, 37374, DOCVQA_PROMPT,
                   lambda out, ex: scoring.anls(out, ex.answers)),
    "ai2d": Task("ai2d", "accuracy", 400, 85393, AI2D_PROMPT,
                 lambda out, ex: scoring.ai2d_accuracy(out, ex.answers[0])),
}
