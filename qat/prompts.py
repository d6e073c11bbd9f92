"""Prompt sampler for the QAT self-distillation data (reference-recipe section 5, LM ``prompt_sampling.py``).

Structure, counts and probabilities are the recipe's; the texts are ours (generic image-comprehension
wording in the recipe's categories).

* Prompt pool (495): 15 :data:`BASE_PROMPTS` followed by every ``"{action} {target} {audience} {style}"``
  for 5 :data:`ACTIONS` x 6 :data:`TARGETS` x 4 :data:`AUDIENCES` x 4 :data:`STYLES` (480, in
  ``itertools.product`` order).
* Instruction block (used w.p. :data:`P_INSTRUCTION` = 0.75): one of 16 :data:`BASE_INSTRUCTIONS`;
  + a length instruction w.p. :data:`P_LENGTH` = 0.75 whose bucket is short / medium / long w.p.
  0.40 / 0.38 / 0.22 (4 / 3 / 3 items); + one of 11 :data:`FORMAT_INSTRUCTIONS` w.p. :data:`P_FORMAT` = 0.45;
  + one of 9 :data:`ADHERENCE_PROBES` w.p. :data:`P_ADHERENCE` = 0.40. Lines joined by ``"\\n"``,
  duplicates removed (first occurrence kept).
* Wrapping: with an instruction block, w.p. :data:`P_WRAP` = 0.7 one of the 4 :data:`INSTRUCTION_WRAPPERS`,
  else ``"{instruction}\\n{prompt}\\n"``; without, one of the 3 :data:`PLAIN_WRAPPERS`.
* Template: ``chat`` (the Llama chat turn) w.p. :data:`P_CHAT` = 0.75, else ``plain`` = ``"<|image|>{prompt}"``.

Probabilities. The recipe's draws are ``template p=[0.25, 0.75]``, ``use_instruction < 0.75``,
``wrap < 0.7`` and a length instruction w.p. 0.75. Issue 6 summarises these as "p_inst 0.7, p_len 0.75";
that 0.7 is the recipe's *wrap* probability, so this module follows the recipe: P_INSTRUCTION = 0.75,
P_WRAP = 0.7.

Choices where the recipe is silent (ours):

* Every "one of N" choice (prompt, instruction, bucket item, format, probe, wrapper) is uniform.
* Seeding: sample ``i`` of a run with master seed ``seed`` uses its own generator
  ``numpy.random.default_rng([seed, i])`` (a SeedSequence over both), so a sample is a pure function of
  ``(seed, i)``: resuming and sharding need no state. The recipe's single vectorised stream cannot
  give that; the default master seed is still the recipe's 693785. Every sample makes the same 13 draws
  in a fixed order (template, prompt, use_instruction, wrap, base instruction, use_length, length bucket,
  length item, use_format, format item, use_adherence, adherence item, wrapper), used or not; the
  recipe's order for the first four.
* The teacher's sampling seed for sample ``i`` is :func:`generation_seed` ``(seed, i)``, from a separate
  SeedSequence stream so that it is independent of the prompt draws.
* Text-only mode uses the same pool (the teacher then answers without an image: what matters for
  self-distillation is the teacher's own output distribution); the plain template is then ``"{prompt}"``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "BASE_PROMPTS", "ACTIONS", "TARGETS", "AUDIENCES", "STYLES", "PROMPT_POOL",
    "BASE_INSTRUCTIONS", "LENGTH_INSTRUCTIONS", "LENGTH_BUCKET_P", "FORMAT_INSTRUCTIONS", "ADHERENCE_PROBES",
    "INSTRUCTION_WRAPPERS", "UNWRAPPED_INSTRUCTION", "PLAIN_WRAPPERS", "PLAIN_TEMPLATE", "PLAIN_TEMPLATE_TEXT",
    "CHAT_TEMPLATE", "CHAT_TEMPLATE_TEXT", "P_CHAT", "P_INSTRUCTION", "P_WRAP", "P_LENGTH", "P_FORMAT",
    "P_ADHERENCE", "DEFAULT_SEED", "SampledPrompt", "sample_prompt", "generation_seed", "build_prompt_pool",
]

DEFAULT_SEED = 693785  # the recipe's master seed

P_CHAT = 0.75  # template index drawn with p = [0.25 (plain), 0.75 (chat)]
P_INSTRUCTION = 0.75  # use_instruction < 0.75
P_WRAP = 0.7  # wrap < 0.7 (given an instruction block)
P_LENGTH = 0.75
P_FORMAT = 0.45
P_ADHERENCE = 0.40

BASE_PROMPTS: tuple[str, ...] = (
    "Describe the image.",
    "What is shown in this image?",
    "Describe this image in detail.",
    "What do you see in this picture?",
    "Give a detailed description of the scene.",
    "What is happening in this image?",
    "Describe the main subject of this photo.",
    "What stands out most in this picture?",
    "List the objects visible in this image.",
    "Describe the colours, lighting and composition of this image.",
    "Where might this photo have been taken, and why?",
    "Write a caption for this image.",
    "What is the mood or atmosphere of this image?",
    "Describe the background of this image.",
    "Explain what this image shows to someone who cannot see it.",
)
ACTIONS: tuple[str, ...] = ("Describe", "Summarize", "Characterize", "Explain", "Caption")
TARGETS: tuple[str, ...] = (
    "the image",
    "this picture",
    "the scene shown",
    "the main subject of this photo",
    "the setting and surroundings in the image",
    "the key details visible in this image",
)
AUDIENCES: tuple[str, ...] = (
    "for a general audience",
    "for a young child",
    "for a domain expert",
    "for someone who cannot see it",
)
STYLES: tuple[str, ...] = (
    "in plain language.",
    "in a neutral, factual tone.",
    "in vivid, descriptive language.",
    "as concisely as possible.",
)

BASE_INSTRUCTIONS: tuple[str, ...] = (
    "Answer based only on what is visible in the image.",
    "Be accurate and do not invent details.",
    "If something is unclear, say so rather than guessing.",
    "Focus on the most important elements first.",
    "Use clear and simple language.",
    "Mention colours, shapes and positions where relevant.",
    "Do not speculate beyond what the image supports.",
    "Be specific rather than generic.",
    "Describe spatial relationships between objects.",
    "Keep a neutral, objective tone.",
    "Mention any text that appears in the image.",
    "Prioritise the main subject over the background.",
    "Avoid repeating yourself.",
    "Use complete sentences.",
    "Refer to objects by their most common names.",
    "Note the number of prominent objects where possible.",
)
LENGTH_INSTRUCTIONS: dict[str, tuple[str, ...]] = {
    "short": (
        "Answer in one sentence.",
        "Keep the answer under 20 words.",
        "Be brief.",
        "Respond with a short phrase.",
    ),
    "medium": (
        "Answer in two to three sentences.",
        "Keep the answer to one short paragraph.",
        "Use about 50 words.",
    ),
    "long": (
        "Give a thorough, detailed answer.",
        "Write at least two paragraphs.",
        "Use about 200 words.",
    ),
}
LENGTH_BUCKET_P: dict[str, float] = {"short": 0.40, "medium": 0.38, "long": 0.22}
FORMAT_INSTRUCTIONS: tuple[str, ...] = (
    "Use bullet points.",
    "Use a numbered list.",
    "Answer in JSON with keys \"summary\" and \"details\".",
    "Start with a one-line summary, then the details.",
    "Write a single paragraph.",
    "Use Markdown headings.",
    "Put each observation on its own line.",
    "End with a one-sentence conclusion.",
    "Answer as a short title followed by a description.",
    "Use a table with the columns \"object\" and \"description\".",
    "Do not use any lists.",
)
ADHERENCE_PROBES: tuple[str, ...] = (
    "Do not mention these instructions in your answer.",
    "Start your answer with the word \"Overall\".",
    "Do not use the word \"image\".",
    "End your answer with a period.",
    "Write in the present tense.",
    "Do not use exclamation marks.",
    "Write in the second person.",
    "Avoid the words \"very\" and \"really\".",
    "Do not start with \"The\".",
)

INSTRUCTION_WRAPPERS: tuple[str, ...] = (
    "{instruction}\n{prompt}\n",
    "Instruction: {instruction}\nTask: {prompt}\n",
    "Follow these instructions exactly.\n{instruction}\n\nTask: {prompt}\n",
    "Task: {prompt}\n\nOutput constraints:\n{instruction}\n",
)
UNWRAPPED_INSTRUCTION = "{instruction}\n{prompt}\n"
PLAIN_WRAPPERS: tuple[str, ...] = ("{prompt}\n", "Task: {prompt}\n", "Question: {prompt}\n")

#: the recipe's two templates (``{prompt}`` = the wrapped prompt); text-only variants drop ``<|image|>``
PLAIN_TEMPLATE = "<|image|>{prompt}"
CHAT_TEMPLATE = ("<|start_header_id|>user<|end_header_id|>\n\n<|image|>{prompt}<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n")
PLAIN_TEMPLATE_TEXT = "{prompt}"
CHAT_TEMPLATE_TEXT = CHAT_TEMPLATE.replace("<|image|>", "")


def build_prompt_pool() -> tuple[str, ...]:
    """The 495 prompts: BASE_PROMPTS, then ``"{action} {target} {audience} {style}"`` in product order."""
    combos = (" ".join(parts) for parts in itertools.product(ACTIONS, TARGETS, AUDIENCES, STYLES))
    return BASE_PROMPTS + tuple(combos)


PROMPT_POOL: tuple[str, ...] = build_prompt_pool()
_BUCKETS = tuple(LENGTH_BUCKET_P)
_BUCKET_P = np.array([LENGTH_BUCKET_P[b] for b in _BUCKETS])


@dataclass(frozen=True)
class SampledPrompt:
    """The sampler's result for one index; ``prompt`` is the wrapped user text (what gets templated)."""

    template: Literal["chat", "plain"]
    base_prompt: str
    instruction: str | None  # the instruction block ("\n"-joined lines), None without one
    length_bucket: str | None  # "short" | "medium" | "long" | None
    wrapped: bool  # an instruction block put in one of INSTRUCTION_WRAPPERS (not UNWRAPPED_INSTRUCTION)
    wrapper: str  # the wrapper format string used
    prompt: str


def _rng(seed: int, index: int, stream: int) -> np.random.Generator:
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0, got seed={seed}, index={index}")
    return np.random.default_rng(np.random.SeedSequence([seed, index, stream]))


def sample_prompt(seed: int, index: int) -> SampledPrompt:
    """Sample ``index`` of the run seeded ``seed`` (a pure function of both; see the module docstring)."""
    rng = _rng(seed, index, 0)
    # the 13 draws, always made in this order
    template: Literal["chat", "plain"] = "chat" if rng.random() < P_CHAT else "plain"
    base_prompt = PROMPT_POOL[int(rng.integers(len(PROMPT_POOL)))]
    use_instruction = rng.random() < P_INSTRUCTION
    wrap = rng.random() < P_WRAP
    base_instruction = BASE_INSTRUCTIONS[int(rng.integers(len(BASE_INSTRUCTIONS)))]
    use_length = rng.random() < P_LENGTH
    bucket = _BUCKETS[int(rng.choice(len(_BUCKETS), p=_BUCKET_P))]
    length_item = LENGTH_INSTRUCTIONS[bucket][int(rng.integers(len(LENGTH_INSTRUCTIONS[bucket])))]
    use_format = rng.random() < P_FORMAT
    format_item = FORMAT_INSTRUCTIONS[int(rng.integers(len(FORMAT_INSTRUCTIONS)))]
    use_adherence = rng.random() < P_ADHERENCE
    adherence_item = ADHERENCE_PROBES[int(rng.integers(len(ADHERENCE_PROBES)))]
    wrapper_u = rng.random()  # wrapper index, scaled to whichever wrapper list applies

    if not use_instruction:
        wrapper = PLAIN_WRAPPERS[int(wrapper_u * len(PLAIN_WRAPPERS))]
        return SampledPrompt(template, base_prompt, None, None, False, wrapper, wrapper.format(prompt=base_prompt))
    lines = [base_instruction]
    if use_length:
        lines.append(length_item)
    if use_format:
        lines.append(format_item)
    if use_adherence:
        lines.append(adherence_item)
    instruction = "\n".join(dict.fromkeys(lines))  # de-duplicated, order kept
    wrapper = INSTRUCTION_WRAPPERS[int(wrapper_u * len(INSTRUCTION_WRAPPERS))] if wrap else UNWRAPPED_INSTRUCTION
    return SampledPrompt(template, base_prompt, instruction, bucket if use_length else None, wrap, wrapper,
                         wrapper.format(instruction=instruction, prompt=base_prompt))


def generation_seed(seed: int, index: int) -> int:
    """The teacher's sampling seed for sample ``index`` (a 31-bit int, independent of the prompt draws)."""
    return int(_rng(seed, index, 1).integers(2**31 - 1))
