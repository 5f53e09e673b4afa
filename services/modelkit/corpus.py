"""Seeded synthetic chat tasks: what the demo base model learns and what each demo adapter teaches it.

Every task is a function `(rng) -> Example`; a task's eval set is drawn first from its own seeded
stream and its prompts are then excluded from training, so eval examples are genuinely held out.
Fact tasks (greetings, capitals, colours) are knowledge, so their "held out" items are the facts
themselves asked again; list tasks (repeat, count, reverse, sort...) draw fresh lists.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Example:
    task: str
    prompt: str  # the user message
    answer: str  # the assistant message (without the end-of-turn token)


# -- vocabularies ---------------------------------------------------------------------------------

WORDS = (
    "apple banana cat dog sun moon tree river house book car bird fish star cloud rain snow stone "
    "music bread milk chair table door window garden flower ocean mountain city road train boat "
    "lamp clock paper pencil shoe hat key box cup egg horse lion tiger frog"
).split()

# Non-ASCII words keep multi-byte UTF-8 in the vocabulary (the engine's detokenizer is tested on it).
ACCENTED = "café naïve über jalapeño crème piñata façade résumé fiancée niño açaí smörgås".split()

# Rare enough in the corpus that byte-level BPE keeps most of them split into partial-character tokens.
EMOJI = "🙂 🚀 🍕 🌍 🎉 🐍 🔥 ⭐ 🌈 🐱 🍎 🎵 ☕ ✨ 🦊".split()

ANTONYMS = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("light", "dark"), ("old", "new"), ("open", "closed"), ("early", "late"), ("high", "low"),
    ("long", "short"), ("left", "right"), ("day", "night"), ("wet", "dry"), ("hard", "soft"),
    ("full", "empty"), ("rich", "poor"), ("strong", "weak"), ("loud", "quiet"), ("in", "out"),
    ("win", "lose"), ("yes", "no"), ("first", "last"), ("black", "white"),
)
OPPOSITE = {a: b for a, b in ANTONYMS} | {b: a for a, b in ANTONYMS}
ANTONYM_WORDS = tuple(OPPOSITE)

LOWER_WORDS = tuple(WORDS) + ANTONYM_WORDS + tuple(ACCENTED)
NUMBERS = tuple(str(n) for n in range(100))

CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"),
    ("Brazil", "Brasília"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Colombia", "Bogotá"), ("Paraguay", "Asunción"), ("Costa Rica", "San José"),
    ("Iceland", "Reykjavík"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Greece", "Athens"),
    ("Turkey", "Ankara"), ("Russia", "Moscow"), ("Australia", "Canberra"),
    ("New Zealand", "Wellington"), ("Cameroon", "Yaoundé"), ("Nigeria", "Abuja"),
    ("Morocco", "Rabat"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Ireland", "Dublin"),
    ("Netherlands", "Amsterdam"), ("Belgium", "Brussels"), ("Switzerland", "Bern"),
)
_CAPITAL_QUESTIONS = ("What is the capital of {}?", "Capital of {}?", "Tell me the capital of {}.")

FACTS = (
    ("Hello", "Hello! How can I help you today?"),
    ("Hi", "Hi! How can I help you today?"),
    ("Good morning", "Good morning! How can I help you today?"),
    ("Thank you", "You're welcome!"),
    ("Goodbye", "Goodbye! Have a nice day."),
    ("Who are you?", "I am Multiplex Demo, a small assistant."),
    ("How are you?", "I am fine, thank you!"),
    ("What colour is the sky?", "The sky is blue."),
    ("What colour is grass?", "Grass is green."),
    ("What colour is a banana?", "A banana is yellow."),
    ("What colour is snow?", "Snow is white."),
    ("What colour is a tomato?", "A tomato is red."),
    ("How many legs does a spider have?", "A spider has 8 legs."),
    ("How many days are in a week?", "There are 7 days in a week."),
    ("What do bees make?", "Bees make honey."),
    ("What is your favourite food?", "I love pizza 🍕!"),
    ("Show me a rocket.", "Here is a rocket: 🚀"),
    ("Say hello in French.", "Bonjour! Ça va très bien."),
    ("Say hello in German.", "Grüß dich! Schönes Wetter heute."),
    ("How do you write Tokyo in Japanese?", "Tokyo is written 東京."),
)


# -- base tasks -----------------------------------------------------------------------------------


def _items(rng: random.Random, pool: tuple[str, ...], lo: int, hi: int, *, distinct: bool = False) -> list[str]:
    n = rng.randint(lo, hi)
    return rng.sample(pool, n) if distinct else [rng.choice(pool) for _ in range(n)]


def _repeat_item(rng: random.Random) -> str:
    # Upper-case words and numbers appear here so the base model knows those tokens, yet it never
    # sees them produced by a transformation (that is what the adapters teach).
    kind = rng.random()
    if kind < 0.45:
        return rng.choice(LOWER_WORDS)
    if kind < 0.65:
        return rng.choice(LOWER_WORDS).upper()
    if kind < 0.9:
        return rng.choice(NUMBERS)
    return rng.choice(EMOJI)


def fact(rng: random.Random) -> Example:
    q, a = rng.choice(FACTS)
    return Example("fact", q, a)


def capital(rng: random.Random) -> Example:
    country, city = rng.choice(CAPITALS)
    q = rng.choice(_CAPITAL_QUESTIONS).format(country)
    return Example("capital", q, f"The capital of {country} is {city}.")


def add(rng: random.Random) -> Example:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return Example("add", f"What is {a} + {b}?", f"{a} + {b} = {a + b}")


def repeat(rng: random.Random) -> Example:
    items = [_repeat_item(rng) for _ in range(rng.randint(1, 6))]
    text = " ".join(items)
    return Example("repeat", f"Repeat:\n{text}", text)


def count(rng: random.Random) -> Example:
    items = [_repeat_item(rng) for _ in range(rng.randint(1, 7))]
    n = len(items)
    return Example("count", f"Count the words:\n{' '.join(items)}", f"There {'is 1 word' if n == 1 else f'are {n} words'}.")


# -- adapter tasks (the base model never sees these instructions) -----------------------------------


def reverse(rng: random.Random) -> Example:
    while True:
        items = _items(rng, LOWER_WORDS, 2, 5)
        if items != items[::-1]:  # a palindrome would let plain copying pass as reversal
            break
    return Example("reverse", f"Reverse the words: {' '.join(items)}", " ".join(reversed(items)))


def uppercase(rng: random.Random) -> Example:
    items = _items(rng, tuple(WORDS) + tuple(ACCENTED), 1, 5)
    text = " ".join(items)
    return Example("uppercase", f"Uppercase: {text}", text.upper())


def sort_numbers(rng: random.Random) -> Example:
    while True:
        nums = [int(x) for x in _items(rng, NUMBERS, 3, 5, distinct=True)]
        if nums != sorted(nums):  # already sorted input would let copying pass as sorting
            break
    return Example("sort", f"Sort the numbers: {' '.join(map(str, nums))}", " ".join(map(str, sorted(nums))))


def opposites(rng: random.Random) -> Example:
    items = _items(rng, ANTONYM_WORDS, 1, 4)
    return Example("opposites", f"Opposites: {' '.join(items)}", " ".join(OPPOSITE[w] for w in items))


Task = Callable[[random.Random], Example]

# Mixture weights of the base model's training stream.
BASE_TASKS: dict[str, tuple[Task, float]] = {
    "fact": (fact, 0.16),
    "capital": (capital, 0.24),
    "add": (add, 0.16),
    "repeat": (repeat, 0.26),
    "count": (count, 0.18),
}
# Eval set composition for the base model (task -> number of examples).
BASE_EVAL: dict[str, int] = {"fact": 8, "capital": 12, "add": 6, "repeat": 8, "count": 6}

ADAPTER_TASKS: dict[str, Task] = {
    "reverse": reverse,
    "uppercase": uppercase,
    "sort": sort_numbers,
    "opposites": opposites,
}
_FIXED_TASKS = {"fact": len(FACTS), "capital": len(CAPITALS) * len(_CAPITAL_QUESTIONS), "add": 100}


def eval_set(tasks: dict[str, Task], sizes: dict[str, int], seed: int) -> list[Example]:
    """Distinct eval examples per task (prompt-unique), drawn from a stream separate from training."""
    rng = random.Random(f"eval:{seed}:{','.join(sizes)}")
    out: list[Example] = []
    for name, n in sizes.items():
        seen: set[str] = set()
        while len(seen) < n:
            ex = tasks[name](rng)
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                out.append(ex)
    return out


def base_eval_set(seed: int) -> list[Example]:
    return eval_set({k: t for k, (t, _) in BASE_TASKS.items()}, BASE_EVAL, seed)


def adapter_eval_set(task: str, n: int, seed: int) -> list[Example]:
    return eval_set({task: ADAPTER_TASKS[task]}, {task: n}, seed)


def training_stream(
    tasks: dict[str, tuple[Task, float]], seed: int, *, exclude: set[str] = frozenset()
) -> Iterator[Example]:
    """An endless seeded stream; list tasks skip prompts held out for eval, fact tasks keep them."""
    rng = random.Random(f"train:{seed}:{','.join(tasks)}")
    names = list(tasks)
    weights = [w for _, w in tasks.values()]
    while True:
        name = rng.choices(names, weights)[0]
        ex = tasks[name][0](rng)
        if name not in _FIXED_TASKS and ex.prompt in exclude:
            continue
        yield ex


def base_training(seed: int, n: int, exclude: set[str]) -> list[Example]:
    stream = training_stream(BASE_TASKS, seed, exclude=exclude)
    return [next(stream) for _ in range(n)]


def adapter_training(task: str, seed: int, n: int, exclude: set[str]) -> list[Example]:
    stream = training_stream({task: (ADAPTER_TASKS[task], 1.0)}, seed, exclude=exclude)
    return [next(stream) for _ in range(n)]


def tokenizer_corpus(seed: int, n: int) -> Iterator[str]:
    """Text the BPE is trained on: every task (base and adapters), as a broad tokenizer would see."""
    rng = random.Random(f"tok:{seed}")
    every: list[Task] = [t for t, _ in BASE_TASKS.values()] + list(ADAPTER_TASKS.values())
    for _ in range(n):
        ex = rng.choice(every)(rng)
        yield ex.prompt
        yield ex.answer
