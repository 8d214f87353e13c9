"""``reasoning``: a short verifiable computation worked in a long, redundant response (issue 28).

The regime of real chains of thought at CPU scale: the answer depends on a few facts of the prompt
and a few intermediate results, but the response is long and mostly redundant (restatements of the
problem, recaps of partial results, re-derivations, filler), so most of its tokens can be dropped
from the KV cache without changing the next token; only a tail of tokens (the facts that are stated
once, far back) must survive. ``running_sum`` is the adversarial opposite and stays the stress test.

Prompt (``facts`` = 4)::

    ask a=7 b=3 c=5 d=2 do a*b+c-d

Response (``far_facts`` = 1, 2 notes per gap; the answer is the text after the last '=')::

    we have a=7 b=3 c=5; do a*b+c-d mod 10.
    step 1: r=a=7.
    note 1: recall a=7 b=3 c=5.
    note 2: so far r=7 at step 1.
    step 2: r*b=7*3=1.
    note 1: recall a=7 b=3 c=5.
    note 2: so far r=1 at step 2.
    step 3: r+c=1+5=6.
    ...
    step 4: r-d=6-2=4.
    note 1: recall a=7 b=3 c=5.
    note 2: so far r=4 at step 4.
    answer=4

* The computation: ``r = a``, then ``r = r op x`` for the next fact ``x`` (ops ``+ - *``, mod 10,
  left to right); facts are digits 1..9. Each step needs the previous ``r`` and one fact.
* After every step comes a gap of ``N`` numbered notes, the same ``N`` for every gap and problem.
  Counting from the end of the gap, the note types cycle ``recap`` (``so far r=R at step S``),
  ``facts`` (the facts restated), ``goal`` (the expression restated), ``hesitate`` (one of four
  phrases, drawn at random per note: the only text that is not a function of the prompt),
  ``redo`` (the last step re-derived), ``hesitate``. So whatever the next step needs (previous
  result, step number, next operator and letter, the operand's value) sits in the last few notes
  before it, and every earlier copy is redundant.
* ``far_facts`` (knob: how many tokens later steps need from far back): the operands of the last
  ``far_facts`` steps are never restated in the response (not in the header nor in the ``facts``
  notes), so those steps must read their value from the prompt, ~4 tokens each, hundreds of tokens
  back. ``far_facts=0``: everything a step needs is in its own last gap; ``far_facts=facts``:
  every operand comes from the prompt.
* ``response_tokens`` (knob: response length): ``N`` is the notes-per-gap count whose mean
  response length (the tokenizer is one token per character) over a fixed sample of problems is
  closest to it; the length grows by ~``facts`` x 27 tokens per note, and varies by a few tokens
  between problems (digits, the hesitation phrases).

The worked response is a function of the prompt and the config (the hesitation draws are seeded by
the prompt's hash), so the answer and the SFT target are reproducible.
"""
from __future__ import annotations

import random
import zlib

from tasks.synthetic import LETTERS, SyntheticTask

OPS = "+-*"
HESITATIONS = ("hmm.", "wait, let me think.", "ok so far.", "let me check again.")
# Note types of a gap, counted backwards from its last note (the one right before the next step).
NOTE_CYCLE = ("recap", "facts", "hesitate", "redo", "goal", "hesitate")
MAX_FACTS = 8
MAX_NOTES = 400
MAX_RESPONSE_TOKENS = 4096
_CALIBRATION_PROBLEMS = 64


def apply(op: str, x: int, y: int) -> int:
    """``x op y`` mod 10."""
    if op == "+":
        return (x + y) % 10
    if op == "-":
        return (x - y) % 10
    if op == "*":
        return (x * y) % 10
    raise ValueError(f"unknown op {op!r}")


def parse_prompt(prompt: str) -> tuple[list[tuple[str, int]], list[str]]:
    """([(letter, value)], [op per step after the first]) of ``ask a=7 b=3 do a*b``."""
    words = prompt.split()
    if len(words) < 4 or words[0] != "ask" or words[-2] != "do":
        raise ValueError(f"not a reasoning prompt: {prompt!r}")
    facts = [(w[0], int(w[2:])) for w in words[1:-2]]
    expr = words[-1]
    return facts, list(expr[1::2])


class ReasoningTask(SyntheticTask):
    """A chain of mod-10 operations over a few facts, worked with restatements and filler."""

    name = "reasoning"

    def __init__(self, seed: int = 0, n_train: int = 4096, n_heldout: int = 256, facts: int = 3,
                 response_tokens: int = 320, far_facts: int = 1):
        if not 2 <= facts <= MAX_FACTS:
            raise ValueError(f"facts must be in 2..{MAX_FACTS}, got {facts}")
        if not 0 <= far_facts <= facts - 1:
            raise ValueError(f"far_facts must be in 0..facts-1 ({facts - 1}), got {far_facts}")
        super().__init__(seed=seed, n_train=n_train, n_heldout=n_heldout, min_terms=facts,
                         max_terms=facts)
        self.facts, self.far_facts, self.response_tokens = facts, far_facts, response_tokens
        self.notes = self._calibrate(response_tokens)

    # -- problems -----------------------------------------------------------------------------
    def _make_prompt(self, rng: random.Random) -> str:
        values = [rng.randint(1, 9) for _ in range(self.facts)]
        ops = [rng.choice(OPS) for _ in range(self.facts - 1)]
        facts = " ".join(f"{LETTERS[i]}={v}" for i, v in enumerate(values))
        return f"ask {facts} do {self._expr(ops)}\n"

    @staticmethod
    def _expr(ops: list[str]) -> str:
        return "a" + "".join(op + LETTERS[i + 1] for i, op in enumerate(ops))

    def solution(self, prompt: str) -> str:
        return self.render(prompt, self.notes)

    def render(self, prompt: str, notes: int) -> str:
        """The worked response with ``notes`` notes per gap (no EOS)."""
        facts, ops = parse_prompt(prompt)
        if len(facts) != self.facts:
            raise ValueError(f"prompt has {len(facts)} facts, the task {self.facts}: {prompt!r}")
        rng = random.Random(zlib.crc32(prompt.encode()))
        expr = self._expr(ops)
        # The far facts (operands of the last far_facts steps) appear in the prompt only.
        near = [f"{k}={v}" for k, v in facts[: len(facts) - self.far_facts]]
        recall = " ".join(near)
        lines = [f"we have {recall}; do {expr} mod 10."]
        r = facts[0][1]
        last = f"r=a={r}"
        for step in range(1, len(facts) + 1):
            if step > 1:
                (k, v), op = facts[step - 1], ops[step - 2]
                nr = apply(op, r, v)
                last = f"r{op}{k}={r}{op}{v}={nr}"
                r = nr
            lines.append(f"step {step}: {last}.")
            for n in range(1, notes + 1):
                kind = NOTE_CYCLE[(notes - n) % len(NOTE_CYCLE)]
                if kind == "recap":
                    nxt = f"next {ops[step - 1]}{facts[step][0]}" if step < len(facts) else "done"
                    body = f"so far r={r} at step {step}; {nxt}."
                elif kind == "facts":
                    body = f"recall {recall}."
                elif kind == "goal":
                    body = f"we do {expr} mod 10."
                elif kind == "redo":
                    body = f"redo step {step}: {last}."
                else:
                    body = rng.choice(HESITATIONS)
                lines.append(f"({n}) {body}")
        lines.append(f"answer={r}")
        return "\n".join(lines)

    # -- the length knob ----------------------------------------------------------------------
    def _calibration_prompts(self) -> list[str]:
        # Fixed (not the seed's problems), so a seed does not move the notes count.
        rng = random.Random(f"{self.name}:calibration:{self.facts}")
        return [self._make_prompt(rng) for _ in range(_CALIBRATION_PROBLEMS)]

    def mean_response_len(self, notes: int) -> float:
        """Mean response length in characters (= tokens of the char tokenizer, plus EOS not
        counted) with ``notes`` notes per gap, over the calibration sample."""
        prompts = self._calibration_prompts()
        return sum(len(self.render(p, notes)) for p in prompts) / len(prompts)

    def mean_prompt_len(self) -> float:
        prompts = self._calibration_prompts()
        return sum(len(p) for p in prompts) / len(prompts)

    def _calibrate(self, target: int) -> int:
        """The notes-per-gap count whose mean response length is closest to ``target``."""
        best, best_err = 0, abs(self.mean_response_len(0) - target)
        for n in range(1, MAX_NOTES + 1):
            err = abs(self.mean_response_len(n) - target)
            if err >= best_err:
                break
            best, best_err = n, err
        return best
