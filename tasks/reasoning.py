"""``reasoning``: a short verifiable computation worked in a long, redundant response (issue 28).

The regime of real chains of thought at CPU scale: the answer depends on a few facts of the prompt
and a few intermediate results, but the response is long and mostly redundant (restatements of the
problem and of the partial result, re-derivations, filler), so most of its tokens can be dropped
from the KV cache without changing the next token; only a tail of tokens (the facts that are stated
once, far back) must survive. ``running_sum`` is the adversarial opposite and stays the stress test.

Prompt (``facts`` = 3)::

    ask a=7 b=5 c=4 do c+a-b

Response (``far_facts`` = 1, 2 notes per gap, the default; the answer is the text after the
last '=')::

    we have a=7 c=4; do c+a-b.
    start r=c=4.
    (1) r=4, left +a-b, a=7 c=4. check c=4.
    (2) r=4, left +a-b, a=7 c=4. let me check again.
    then r+a=4+7=11.
    (1) r=11, left -b, a=7 c=4. check 4+7=11.
    (2) r=11, left -b, a=7 c=4. ok so far.
    then r-b=11-5=6.
    (1) r=6, left none, a=7 c=4. check 11-5=6.
    (2) r=6, left none, a=7 c=4. let me check again.
    answer=6

* The computation: the expression names every fact once, in a random order (``do c+a-b``):
  ``r`` = its first fact, then ``r = r op x`` for each next fact ``x``, left to right. Facts are
  digits 1..9, ops ``+`` and ``-`` (``-`` only where the result stays >= 0, so every
  intermediate result is a whole number 0..9 x facts). Each step needs the previous ``r`` and
  one fact, looked up by its letter. (Plain rather than modular arithmetic, and no ``*``: the
  tiny base model learns sums far faster than a mod-10 table.)
* After every step comes a gap of ``N`` numbered notes, the same ``N`` for every gap and problem.
  Every note restates the state: the partial result, the operations left and the facts (all but
  the far ones), then adds a body; counting from the end of the gap the bodies cycle
  ``hesitate`` (one of four phrases, drawn at random per note: the only text that is not a
  function of the prompt), ``check`` (the last step re-derived), ``goal`` (the expression
  restated). So each line can be written from the line before it, the next step reads its
  result, operation and (near) operand from the last note, the answer from the last note, and
  every earlier copy is redundant: a step needs the last ~40 tokens and its far fact.
* ``far_facts`` (knob: how many tokens later steps need from far back): the operands of the last
  ``far_facts`` steps are never restated in the response (not in the header nor in the ``facts``
  notes), so those steps must read their value from the prompt, ~4 tokens each, hundreds of tokens
  back. ``far_facts=0``: everything a step needs is in its own last gap; ``far_facts=facts-1``
  (the most): only the first operand is restated.
* ``response_tokens`` (knob: response length): ``N`` is the notes-per-gap count whose mean
  response length (the tokenizer is one token per character) over a fixed sample of problems is
  closest to it; each note adds 15-35 tokens to each of the ``facts`` gaps, and the length
  varies by a few tokens between problems (digits, the hesitation phrases).

The worked response is a function of the prompt and the config (the hesitation draws are seeded by
the prompt's hash), so the answer and the SFT target are reproducible.
"""
from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

from tasks.synthetic import LETTERS, SyntheticTask

OPS = "+-"
HESITATIONS = ("hmm.", "wait, let me think.", "ok so far.", "let me check again.")
# Note types of a gap, counted backwards from its last note (the one right before the next step).
NOTE_CYCLE = ("hesitate", "check", "goal")
MAX_FACTS = 8
MAX_NOTES = 400
MAX_RESPONSE_TOKENS = 4096
_CALIBRATION_PROBLEMS = 64
# A step line as the worked response writes it (``then r+c=6+8=14.``): op, letter, r, op, operand.
STEP_LINE = re.compile(r"then r([+-])([a-z])=(\d+)([+-])(\d+)=")


@dataclass(frozen=True)
class Lookup:
    """One operand a response reads by its letter (a ``then`` line after the first step).

    Offsets count characters of prompt + response, i.e. token positions under the task's
    one-token-per-character tokenizer."""
    letter: str
    far: bool                  # the letter is a far fact: its value is stated in the prompt only
    at: int                    # the operand's first digit as written
    right: bool                # the digits written are the fact's value
    sources: tuple[int, ...]   # every earlier digit stating the fact (``k=v``, prompt or response)


def apply(op: str, x: int, y: int) -> int:
    """``x op y``."""
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    raise ValueError(f"unknown op {op!r}")


def pick_op(rng: random.Random, r: int, v: int) -> str:
    """A uniformly drawn op whose result ``r op v`` stays >= 0."""
    return rng.choice([op for op in OPS if apply(op, r, v) >= 0])


def parse_prompt(prompt: str) -> tuple[list[tuple[str, int]], list[str], list[str]]:
    """([(letter, value)] in prompt order, [letter per step], [op per step after the first]) of
    ``ask a=7 b=3 c=4 do b-a+c``."""
    words = prompt.split()
    if len(words) < 4 or words[0] != "ask" or words[-2] != "do":
        raise ValueError(f"not a reasoning prompt: {prompt!r}")
    facts = [(w[0], int(w[2:])) for w in words[1:-2]]
    expr = words[-1]
    return facts, list(expr[0::2]), list(expr[1::2])


class ReasoningTask(SyntheticTask):
    """A chain of + and - over a few facts, worked with restatements and filler."""

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
        order = rng.sample(range(self.facts), self.facts)   # the expression's letters, in turn
        ops, r = [], values[order[0]]
        for i in order[1:]:
            ops.append(pick_op(rng, r, values[i]))
            r = apply(ops[-1], r, values[i])
        facts = " ".join(f"{LETTERS[i]}={v}" for i, v in enumerate(values))
        expr = LETTERS[order[0]] + "".join(op + LETTERS[i] for op, i in zip(ops, order[1:]))
        return f"ask {facts} do {expr}\n"

    def solution(self, prompt: str) -> str:
        return self.render(prompt, self.notes)

    def render(self, prompt: str, notes: int) -> str:
        """The worked response with ``notes`` notes per gap (no EOS)."""
        facts, order, ops = parse_prompt(prompt)
        if len(facts) != self.facts:
            raise ValueError(f"prompt has {len(facts)} facts, the task {self.facts}: {prompt!r}")
        rng = random.Random(zlib.crc32(prompt.encode()))
        value = dict(facts)
        expr = order[0] + "".join(op + k for op, k in zip(ops, order[1:]))
        # The far facts (operands of the last far_facts steps) appear in the prompt only.
        far = set(order[len(order) - self.far_facts:])
        recall = " ".join(f"{k}={v}" for k, v in facts if k not in far)
        lines = [f"we have {recall}; do {expr}."]
        r = value[order[0]]
        check = f"{order[0]}={r}"
        for step in range(1, len(facts) + 1):
            if step == 1:
                lines.append(f"start r={order[0]}={r}.")
            else:
                k, op = order[step - 1], ops[step - 2]
                nr = apply(op, r, value[k])
                check = f"{r}{op}{value[k]}={nr}"
                lines.append(f"then r{op}{k}={check}.")
                r = nr
            left = "".join(op + k for op, k in zip(ops[step - 1:], order[step:])) or "none"
            for n in range(1, notes + 1):
                kind = NOTE_CYCLE[(notes - n) % len(NOTE_CYCLE)]
                if kind == "check":
                    body = f"check {check}."
                elif kind == "goal":
                    body = f"we do {expr}."
                else:
                    body = rng.choice(HESITATIONS)
                lines.append(f"({n}) r={r}, left {left}, {recall}. {body}")
        lines.append(f"answer={r}")
        return "\n".join(lines)

    def lookups(self, prompt: str, response: str) -> list[Lookup]:
        """The operand lookups of a (generated) response to ``prompt``, in order: every ``then``
        line whose letter is one of the prompt's facts, whether it wrote the right value, and
        where that value was stated before it (the prompt's ``k=v`` and every ``k=v`` of the
        response before the line). What a compressed cache must keep for the step to be right."""
        facts, order, _ = parse_prompt(prompt)
        value = dict(facts)
        far = set(order[len(order) - self.far_facts:]) if self.far_facts else set()
        out = []
        for m in STEP_LINE.finditer(response):
            k = m.group(2)
            if k not in value:
                continue
            stated = rf"(?<![a-z]){k}=(\d)"
            sources = [x.start(1) for x in re.finditer(stated, prompt)]
            sources += [len(prompt) + x.start(1)
                        for x in re.finditer(stated, response[:m.start()])]
            out.append(Lookup(letter=k, far=k in far, at=len(prompt) + m.start(5),
                              right=int(m.group(5)) == value[k], sources=tuple(sources)))
        return out

    def drill(self, rng: random.Random, lines: int = 48) -> list[tuple[str, str]]:
        """Arithmetic drill for building a base model (not a problem of the task): ``lines``
        pairs (``"17+5="``, ``"22"``) of the task's operations in the form its steps compute
        in (left operand 0..9 x (facts - 1), right 1..9, results >= 0). A worked response holds
        only ``facts - 1`` results among hundreds of tokens: too few for a tiny model to learn
        its sums in minutes."""
        out = []
        for _ in range(lines):
            x, y = rng.randint(0, 9 * (self.facts - 1)), rng.randint(1, 9)
            op = pick_op(rng, x, y)
            out.append((f"{x}{op}{y}=", str(apply(op, x, y))))
        return out

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
