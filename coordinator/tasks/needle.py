"""Needle retrieval: `The magic number of the silver falcon is 4821.` among filler sentences and other
needles, some with keys that share a word with the asked one."""

import random

from pydantic import Field, model_validator

from .base import Item
from .context import ADJECTIVES, NOUNS, HaystackConfig


class NeedleConfig(HaystackConfig):
    needles: int = Field(4, ge=1, description="needle sentences in the context; the question asks for one of them")
    similar_keys: int = Field(
        1, ge=0, description="other needles whose key shares a word with the asked key (`silver heron`, `golden falcon`)"
    )

    @model_validator(mode="after")
    def _needle(self):
        if self.similar_keys > self.needles - 1:
            raise ValueError(
                f"similar_keys={self.similar_keys} needs needles >= {self.similar_keys + 1} (the asked needle plus "
                f"the similar ones; got needles={self.needles}); raise needles or lower similar_keys"
            )
        most = 2 * (len(ADJECTIVES) - 1)
        if self.similar_keys > most:
            raise ValueError(f"similar_keys={self.similar_keys}: at most {most} keys share a word with the asked one")
        unrelated = (len(ADJECTIVES) - 1) * (len(NOUNS) - 1)
        if self.needles - 1 - self.similar_keys > unrelated:
            raise ValueError(f"needles={self.needles}: at most {unrelated} keys share no word with the asked one; lower needles")
        self.check_room(1, self.needles - 1, f"needles={self.needles}")
        self.check_values(self.needles, f"needles={self.needles}")
        return self


class NeedleTask:
    def __init__(self, config: NeedleConfig):
        self.config = config

    def keys(self, rng: random.Random) -> list[tuple[str, str]]:
        """The asked key first, then `similar_keys` sharing its adjective or noun (alternately), then unrelated ones."""
        c = self.config
        adjective, noun = rng.choice(ADJECTIVES), rng.choice(NOUNS)
        other_nouns = rng.sample([n for n in NOUNS if n != noun], (c.similar_keys + 1) // 2)
        other_adjectives = rng.sample([a for a in ADJECTIVES if a != adjective], c.similar_keys // 2)
        keys = [(adjective, noun)]
        for i in range(c.similar_keys):
            keys.append((adjective, other_nouns[i // 2]) if i % 2 == 0 else (other_adjectives[i // 2], noun))
        taken = set(keys)
        while len(keys) < c.needles:
            key = (rng.choice(ADJECTIVES), rng.choice(NOUNS))
            if key not in taken and key[0] != adjective and key[1] != noun:
                keys.append(key)
                taken.add(key)
        return keys

    def item(self, rng: random.Random) -> Item:
        c = self.config
        keys = self.keys(rng)
        values = rng.sample(range(c.min_value, c.max_value + 1), c.needles)
        sentences = [f"The magic number of the {a} {n} is {v}." for (a, n), v in zip(keys, values)]
        context = c.context(rng, sentences[:1], sentences[1:])
        adjective, noun = keys[0]
        return c.render(f"What is the magic number of the {adjective} {noun}?", context), str(values[0])
