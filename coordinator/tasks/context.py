"""The haystack shared by the long-context tasks: names, filler sentences, and where the answer-bearing lines go.

Everything is drawn from the caller's `random.Random`. No word list contains a digit and the filler's
words are disjoint from the names, so the only numbers in a prompt are the task's values and the
last integer of a reply is its answer (the integer reward of `coordinator/rewards.py`).
"""

import random

from pydantic import Field, field_validator, model_validator

from .base import TaskConfig

NOUNS = tuple("""
apple arrow badge banana barrel basket beacon beetle bell berry blanket blossom bottle bracelet bread brick
broom brush bucket buckle butter button cabbage cactus cake camel camera candle cannon canoe canvas carpet
carrot castle cedar chain chair chalk cherry chess chimney cinnamon circus clock cloud clover coconut collar
comet compass cookie cork cotton crayon crown crystal cucumber cup curtain cushion daisy desk diamond dolphin
donkey dragon drum duck eagle engine envelope falcon feather fern fiddle flag flame flute fox frog garlic
giraffe glove goat grape guitar hammer hamster harp hawk helmet hive honey hook horn igloo island jacket jar
jelly jewel kayak kettle kite kitten koala ladder lamp lantern lemon leopard lettuce lily lion lizard lobster
lock magnet mango maple marble mask meadow melon mirror mitten monkey moose mouse muffin mushroom needle nest
noodle oak oar octopus onion orchid otter owl oyster paddle panda parrot peach peanut pear pebble pelican
pencil penguin pepper piano pickle pigeon pillow pine pizza planet plum pony poppy potato pumpkin puppet quilt
rabbit raccoon radio radish raft raisin rocket saddle salmon sandal scarf scissors shark sheep shell shovel
skate sled snail sock spider spinach spoon squid squirrel stamp statue strawberry sugar swan sweater table
teapot tent thimble thistle tiger toast tomato torch tortoise towel tractor trumpet tulip turkey turnip turtle
umbrella unicorn vase violin volcano wagon walnut walrus wasp whale whistle willow wizard wolf yacht yarn zebra
zipper
""".split())
"""Variable names of the lookup task and nouns of the needle keys."""

ADJECTIVES = tuple("""
amber azure bitter brave bronze crimson dusty eager fancy fierce gentle giant golden happy hidden humble icy
jolly lazy lucky merry mighty misty noble rapid royal rusty scarlet secret shiny silent silver sleepy smooth
sunny swift tiny wild wise witty
""".split())
"""First words of the needle keys (`the silver falcon`)."""

SUBJECTS = ("The baker", "A sailor", "The mayor", "My cousin", "The gardener", "A student", "The old doctor",
            "Our neighbour", "The young painter", "A weary hiker", "The shopkeeper", "The librarian")
VERBS = ("walked along", "talked about", "waited near", "thought about", "painted", "repaired", "remembered",
         "described", "visited", "cleaned", "photographed", "sketched")
PLACES = ("the harbour road", "the old mill", "the village square", "an empty street", "the morning market",
          "a distant hill", "the stone wall", "the river bank", "a narrow lane", "the train station",
          "the public garden", "the school yard")
TIMES = ("before lunch.", "in the rain.", "for a long time.", "without a word.", "after the storm.", "on a Sunday.",
         "with great care.", "at dawn.", "once again.", "as usual.", "late in the evening.", "during the holidays.")


def filler_sentence(rng: random.Random) -> str:
    """One line of distractor text (12⁴ sentences, none with a number or a name)."""
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(PLACES)} {rng.choice(TIMES)}"


def spread(rng: random.Random, count: int, lines: int, depth: tuple[float, float]) -> list[int]:
    """Line indices for `count` answer-bearing lines: the j-th sits at a random point of the middle half
    of the j-th of `count` equal parts of the `depth` span (0 = first line, 1 = last line), so
    consecutive ones are at least half a part apart."""
    lo, hi = depth
    part = (hi - lo) / count
    return [int((lo + part * (j + 0.25 + 0.5 * rng.random())) * (lines - 1) + 0.5) for j in range(count)]


def layout(rng: random.Random, lines: int, depth: tuple[float, float], relevant: list[str], others: list[str]) -> str:
    """`lines` lines: `relevant` spread over `depth` in the given order, `others` at random free lines,
    filler sentences everywhere else."""
    slots: list[str | None] = [None] * lines
    for pos, text in zip(spread(rng, len(relevant), lines, depth), relevant):
        slots[pos] = text
    free = [i for i, s in enumerate(slots) if s is None]
    for pos, text in zip(rng.sample(free, len(others)), others):
        slots[pos] = text
    return "\n".join(s if s is not None else filler_sentence(rng) for s in slots)


class HaystackConfig(TaskConfig):
    """Knobs every long-context task shares. Length is set in lines (the data layer has no tokenizer);
    docs/tasks.md gives the tokens per line of SmolLM2's tokenizer."""

    context_lines: tuple[int, int] = Field(
        (200, 200), description="lines of context (the task's lines plus filler sentences): [min, max], drawn "
        "uniformly per item so a job's lengths span several α bins; one number = a fixed length"
    )
    depth: tuple[float, float] = Field(
        (0.0, 1.0), description="span of the context (0 = first line, 1 = last) over which the answer-bearing "
        "lines are spread, one per equal part"
    )
    min_value: int = Field(10, description="smallest value in the context")
    max_value: int = Field(99, description="largest value in the context")
    template: str = Field(
        "Question: {question}\n\n{context}\n\nQuestion: {question}",
        description="the user message; {context} and {question} are replaced",
    )

    @field_validator("context_lines", mode="before")
    @classmethod
    def _fixed(cls, value):
        return (value, value) if isinstance(value, int) else value

    @model_validator(mode="after")
    def _haystack(self):
        shortest, longest = self.context_lines
        if not 1 <= shortest <= longest:
            raise ValueError(f"context_lines={list(self.context_lines)}: need 1 <= min <= max")
        lo, hi = self.depth
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"depth={list(self.depth)}: need 0 <= low <= high <= 1 (fractions of the context)")
        if self.max_value < self.min_value:
            raise ValueError(f"max_value={self.max_value} is below min_value={self.min_value}; swap them")
        for key in ("{context}", "{question}"):
            if key not in self.template:
                raise ValueError(f"template={self.template!r} has no {key} placeholder")
        return self

    def check_room(self, answer_lines: int, other_lines: int, what: str) -> None:
        """The shortest context holds the task's lines, and `answer_lines` of them spread over `depth` fall on distinct lines."""
        shortest = self.context_lines[0]
        if answer_lines + other_lines > shortest:
            raise ValueError(
                f"context_lines={shortest} is too short for {what} ({answer_lines + other_lines} lines); "
                f"raise context_lines or ask for fewer"
            )
        lo, hi = self.depth
        if answer_lines > 1 and (hi - lo) * (shortest - 1) < 2 * answer_lines:
            raise ValueError(
                f"depth={list(self.depth)} over context_lines={shortest} is too narrow to put "
                f"{answer_lines} answer-bearing lines on distinct lines; widen depth or raise context_lines"
            )

    def check_values(self, distinct: int, what: str) -> None:
        span = self.max_value - self.min_value + 1
        if span < distinct:
            raise ValueError(
                f"min_value={self.min_value}..max_value={self.max_value} holds {span} values, fewer than the "
                f"{distinct} distinct values of {what}; widen the range"
            )

    def context(self, rng: random.Random, relevant: list[str], others: list[str]) -> str:
        """A context of a drawn length with these lines (`layout`)."""
        return layout(rng, rng.randint(*self.context_lines), self.depth, relevant, others)

    def render(self, question: str, context: str) -> list[dict]:
        return [{"role": "user", "content": self.template.replace("{context}", context).replace("{question}", question)}]
