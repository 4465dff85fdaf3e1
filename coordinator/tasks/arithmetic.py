"""The arithmetic task: integer expressions such as `17 - 4 + 9`; the exact answer is Python's evaluation."""

import random
from typing import Literal

from pydantic import Field, model_validator

from .base import Item, TaskConfig


class ArithmeticConfig(TaskConfig):
    """The built-in verifiable task: integer expressions with exact answers."""

    min_value: int = Field(1, description="smallest operand")
    max_value: int = Field(20, description="largest operand")
    terms: int = Field(2, ge=2, le=8, description="operands per expression")
    operations: list[Literal["+", "-", "*"]] = Field(
        default_factory=lambda: ["+", "-"], min_length=1, description="operators drawn between operands (* binds first)"
    )
    template: str = Field(
        "Calculate {expression}. End your reply with the result as a number.",
        description="the user message; {expression} is replaced by the problem",
    )

    @model_validator(mode="after")
    def _range(self):
        if self.max_value < self.min_value:
            raise ValueError(f"max_value={self.max_value} is below min_value={self.min_value}; swap them")
        if "{expression}" not in self.template:
            raise ValueError(f"template={self.template!r} has no {{expression}} placeholder for the problem")
        return self


def evaluate(values: list[int], ops: list[str]) -> int:
    """`values[0] ops[0] values[1] ...` with * before + and -."""
    terms, signs = [values[0]], []
    for op, v in zip(ops, values[1:]):
        if op == "*":
            terms[-1] *= v
        else:
            terms.append(v)
            signs.append(1 if op == "+" else -1)
    return terms[0] + sum(s * t for s, t in zip(signs, terms[1:]))


class ArithmeticTask:
    def __init__(self, config: ArithmeticConfig):
        self.config = config

    def problem(self, rng: random.Random) -> tuple[str, int]:
        c = self.config
        values = [rng.randint(c.min_value, c.max_value) for _ in range(c.terms)]
        ops = [rng.choice(c.operations) for _ in range(c.terms - 1)]
        expression = " ".join([str(values[0])] + [f"{op} {v}" for op, v in zip(ops, values[1:])])
        return expression.replace("+ -", "- ").replace("- -", "+ "), evaluate(values, ops)

    def item(self, rng: random.Random) -> Item:
        expression, answer = self.problem(rng)
        return [{"role": "user", "content": self.config.template.replace("{expression}", expression)}], str(answer)
