"""Variable lookup over `hops` definitions: `tulip = 42`, `otter = tulip`, ... "What is the value of otter?".

The asked variable's chain of definitions is spread over the context among distractor chains of the
same shape and filler sentences; every hop is one more line the model has to find.
"""

import random

from pydantic import Field, model_validator

from .base import Item
from .context import NOUNS, HaystackConfig


class LookupConfig(HaystackConfig):
    hops: int = Field(2, ge=1, le=16, description="definitions on the asked variable's chain (1 = a direct lookup)")
    distractors: int = Field(6, ge=0, description="other definitions, in chains of `hops` lines (the last may be shorter)")
    max_offset: int = Field(
        0, ge=0, le=9, description="0: a hop copies (`otter = tulip`); > 0: it adds 1..max_offset (`otter = tulip + 3`)"
    )

    @model_validator(mode="after")
    def _lookup(self):
        names = self.hops + self.distractors
        if names > len(NOUNS):
            raise ValueError(
                f"hops={self.hops} + distractors={self.distractors} = {names} variables; at most {len(NOUNS)} names "
                "exist; lower distractors"
            )
        self.check_room(self.hops, self.distractors, f"hops={self.hops} + distractors={self.distractors} definitions")
        self.check_values(self.chains, f"the {self.chains} chains' root values")
        return self

    @property
    def chains(self) -> int:
        return 1 + -(-self.distractors // self.hops)


class LookupTask:
    def __init__(self, config: LookupConfig):
        self.config = config

    def item(self, rng: random.Random) -> Item:
        c = self.config
        names = rng.sample(NOUNS, c.hops + c.distractors)
        chains = [names[i : i + c.hops] for i in range(0, len(names), c.hops)]
        roots = rng.sample(range(c.min_value, c.max_value + 1), len(chains))
        definitions, values = [], []
        for chain, root in zip(chains, roots):
            lines, value = [f"{chain[0]} = {root}"], root
            for ref, name in zip(chain, chain[1:]):
                offset = rng.randint(1, c.max_offset) if c.max_offset else 0
                lines.append(f"{name} = {ref} + {offset}" if offset else f"{name} = {ref}")
                value += offset
            definitions.append(lines)
            values.append(value)
        asked = definitions[0]
        rng.shuffle(asked)  # the chain's order in the context is random, not root first
        context = c.context(rng, asked, [line for d in definitions[1:] for line in d])
        return c.render(f"What is the value of {chains[0][-1]}?", context), str(values[0])
